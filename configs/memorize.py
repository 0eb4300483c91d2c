"""Memorisation (the MAD suite, Poli et al. 2024): a decoder-only Transformer learns one fixed map
of keys to values that no row states, so what it recalls is what its parameters hold.

Rows of L = 64 tokens: 20 distinct keys of a map of 4,096 (each key two tokens of 64 parts), each
followed by its value (256 value words); the loss and accuracy are on the values
(data/synthetic.py). The map is the same in every split, so the test accuracy is the share of the
map the model has stored, which needs parameters: feed-forward width (model.d_ff) or experts
(model.moe_experts).

Train: python train.py --config=configs/memorize.py --workdir=DIR [--config.model.d_ff=1024]
Eval:  python eval.py --workdir=DIR
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.data.task = 'memorize'
  config.data.max_length = 64
  config.data.synthetic.pairs = 20
  config.data.synthetic.keys = 16384
  config.data.synthetic.values = 256
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  if 'quick' in default.parse_arg(arg):
    config.data.max_length = 16
    config.data.synthetic.pairs = 4
    config.data.synthetic.keys = 32
    config.data.synthetic.values = 16
    return config
  config.model.num_layers = 2
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.train.batch_size = 64
  config.train.steps = 3000
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 200
  config.train.eval_every = 500
  config.train.eval_batches = 0
  config.train.checkpoint_every = 1000
  config.train.log_every = 100
  return config
