"""Selective copying (Gu & Dao 2023): a decoder-only Transformer copies the data tokens scattered
among blanks, in order, after a `<copy>` marker.

Rows of L = 128 tokens: 16 data tokens at random places of 111 blanks, `<copy>`, the 16 tokens;
the loss and accuracy are on the copied tokens (data/synthetic.py). The places vary row to row, so
a fixed convolution cannot copy them; attention can select them by content.

Train: python train.py --config=configs/selective_copy.py --workdir=DIR
Eval:  python eval.py --workdir=DIR
"""

from configs import synthetic


def get_config(arg=None):
  return synthetic.get_task_config(arg, 'selective_copy', max_length=128, steps=2000, pairs=16,
                                   value_vocab=16, quick={'max_length': 32, 'pairs': 4})
