"""Length extrapolation: a decoder-only LM on the toy stream, trained at L=64, evaluated at 2L..8L.

Train: python train.py --config=configs/extrapolation.py --workdir=DIR --config.model.position=alibi
Eval:  python eval.py --workdir=DIR --lengths=1,2,4,8 [--rope_scaling=ntk:4]
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  config.model.num_layers = 6
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.data.packing = 'stream'  # attention crosses pair boundaries, as in LM perplexity studies
  config.data.max_length = 64
  config.train.loss_on = 'all'
  config.train.batch_size = 32
  config.train.steps = 1000
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 100
  config.train.eval_every = 250
  config.train.checkpoint_every = 250
  if 'quick' in default.parse_arg(arg):
    config.train.steps, config.train.warmup_steps = 20, 5
    config.train.eval_every = config.train.checkpoint_every = 10
  return config
