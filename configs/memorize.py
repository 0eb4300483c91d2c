"""Memorisation (the MAD suite, Poli et al. 2024): a decoder-only Transformer learns one fixed map
of keys to values that no row states, so what it recalls is what its parameters hold.

Rows of L = 64 tokens: 20 distinct keys of a map of 65,536 (each key two tokens of 256 parts), each
followed by its value (256 value words); the loss and accuracy are on the values
(data/synthetic.py). The map is the same in every split, so the test accuracy is the share of the
map the model has stored, which needs parameters: feed-forward width (model.d_ff) or experts
(model.moe_experts).

Train: python train.py --config=configs/memorize.py --workdir=DIR [--config.model.d_ff=1024]
Eval:  python eval.py --workdir=DIR
"""

from configs import synthetic


def get_config(arg=None):
  return synthetic.get_task_config(
      arg, 'memorize', max_length=64, steps=3000, learning_rate=2e-3, pairs=20, key_vocab=65536,
      value_vocab=256, quick={'max_length': 16, 'pairs': 4, 'key_vocab': 32, 'value_vocab': 16})
