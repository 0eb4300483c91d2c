"""Selective copying (Gu & Dao 2023): a decoder-only Transformer copies the data tokens scattered
among blanks, in order, after a `<copy>` marker.

Rows of L = 128 tokens: 16 data tokens at random places of 111 blanks, `<copy>`, the 16 tokens;
the loss and accuracy are on the copied tokens (data/synthetic.py). The places vary row to row, so
a fixed convolution cannot copy them; attention can select them by content.

Train: python train.py --config=configs/selective_copy.py --workdir=DIR
Eval:  python eval.py --workdir=DIR
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.data.task = 'selective_copy'
  config.data.max_length = 128
  config.data.synthetic.pairs = 16
  config.data.synthetic.values = 16
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
