"""Language modelling on real code: the local Python standard library's source files (tests left
out), one document each, with long-range structure (names defined far earlier, indentation,
brackets), so that loss beyond the training length and sliding-window loss say whether a model
uses more context (data/python_code.py).

Train: python train.py --config=configs/python_code.py --workdir=DIR
Eval:  python eval.py --workdir=DIR --lengths=1,2,4,8
Quick: configs/python_code.py:quick (60 files a split, a tiny model, 20 steps)
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.data.task = 'python_code'
  config.data.vocab_size = 4000
  config.data.max_length = 256
  config.data.packing = 'stream'
  config.train.loss_on = 'all'
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  if 'quick' in default.parse_arg(arg):
    config.data.code_max_files = 60
    config.data.vocab_size = 500
    config.data.max_length = 64
    return config
  config.model.num_layers = 4
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.train.batch_size = 32
  config.train.steps = 2000
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 200
  config.train.eval_every = 500
  config.train.eval_batches = 16
  config.train.checkpoint_every = 1000
  config.train.log_every = 100
  return config
