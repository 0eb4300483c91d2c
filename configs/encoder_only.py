"""Encoder-only masked-token prediction over `<bos> source <sep> target <eos>` (BERT masking)."""

from configs import default


def get_config(arg=None):
  """`arg` as in configs/default.py (`quick`, `size=NAME`)."""
  config = default.get_config(arg)
  config.model.arch = 'encoder_only'
  config.model.mlm_rate = 0.15
  # Half the rows hide their whole target, so the model also learns to translate in one pass
  # (eval.py's non-autoregressive translation score); the other half is plain BERT masking.
  config.model.mlm_target_rate = 0.5
  if not default.parse_arg(arg).get('quick'):
    config.train.steps = 2000
    config.train.eval_every = 250
  config.data.max_length = 40  # <bos> source (<= 12) <sep> target (<= 18) <eos>
  return config
