"""Encoder-decoder translation on the toy task: source -> target, loss on the target."""

from configs import default


def get_config(arg=None):
  """`arg` as in configs/default.py (`quick`, `size=NAME`)."""
  config = default.get_config(arg)
  config.model.arch = 'encoder_decoder'
  config.model.share_embeddings = True
  if not default.parse_arg(arg).get('quick'):
    # Two small stacks train to their best in a few minutes on a laptop CPU.
    config.model.num_layers = 2
    config.train.steps = 1500
    config.train.warmup_steps = 100
    config.train.learning_rate = 2e-3
    config.train.eval_every = 250
  config.data.max_length = 24  # longest in-length pair: source 12 + eos, target 18 + eos
  return config
