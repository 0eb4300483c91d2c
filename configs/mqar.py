"""Multi-query associative recall (Zoology): a decoder-only Transformer looks up the values of keys
it saw earlier in the row.

Rows of L = 128 tokens: 16 key-value pairs, then the 16 keys asked again at random places of a
noise region, each followed by its value; the loss and accuracy are on the asked values alone
(data/synthetic.py). Dense attention solves it at this width; a fixed-size state (attention=linear)
must hold all 16 pairs at once and falls short. eval.py reports the recall accuracy
(`accuracy.test`), and by number of pairs and key-query distance (eval.json `recall`).

Train: python train.py --config=configs/mqar.py --workdir=DIR [--config.model.attention=linear]
Eval:  python eval.py --workdir=DIR
"""

from configs import synthetic


def get_config(arg=None):
  return synthetic.get_task_config(arg, 'mqar', max_length=128, steps=2000, pairs=16, key_vocab=64,
                                   value_vocab=64, quick={'max_length': 32, 'pairs': 4})
