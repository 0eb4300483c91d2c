"""Induction (Olsson et al. 2022): a decoder-only Transformer copies the token that followed the
previous occurrence of the current one.

Rows of L = 128 tokens: noise, a segment of 16 distinct tokens, more noise, the segment again; the
loss and accuracy are on the repeat's tokens after its first (data/synthetic.py). Two layers can
form an induction head (a previous-token head feeding a copying head); one layer of attention
cannot, which `--config.model.num_layers=1` shows.

Train: python train.py --config=configs/induction.py --workdir=DIR
Eval:  python eval.py --workdir=DIR
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.data.task = 'induction'
  config.data.max_length = 128
  config.data.synthetic.pairs = 16
  config.data.synthetic.values = 64
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  if 'quick' in default.parse_arg(arg):
    config.data.max_length = 32
    config.data.synthetic.pairs = 4
    return config
  config.model.num_layers = 2
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.train.batch_size = 64
  config.train.steps = 2000
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 200
  config.train.eval_every = 500
  config.train.eval_batches = 0
  config.train.checkpoint_every = 1000
  config.train.log_every = 100
  return config
