"""Induction (Olsson et al. 2022): a decoder-only Transformer copies the token that followed the
previous occurrence of the current one.

Rows of L = 128 tokens: noise, a segment of 16 distinct tokens, more noise, the segment again; the
loss and accuracy are on the repeat's tokens after its first (data/synthetic.py). Two layers can
form an induction head (a previous-token head feeding a copying head); one layer of attention
cannot, which `--config.model.num_layers=1` shows.

Train: python train.py --config=configs/induction.py --workdir=DIR
Eval:  python eval.py --workdir=DIR
"""

from configs import synthetic


def get_config(arg=None):
  return synthetic.get_task_config(arg, 'induction', max_length=128, steps=2000, pairs=16,
                                   value_vocab=64, quick={'max_length': 32, 'pairs': 4})
