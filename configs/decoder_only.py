"""Decoder-only translation on the toy task: `<bos> source <sep> target <eos>`, loss on the target."""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.model.arch = 'decoder_only'
  return config
