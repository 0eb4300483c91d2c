"""Weight initialisers and projection biases chosen by `config.model` (kernel_init, *_bias)."""

from flax import nnx

from layers import options

# `config.model.kernel_init`: the initialiser of every projection kernel (attention q/k/v/o, the
# feed-forward networks, an untied output). Both act on the 2-D `[fan_in, fan_out]` view of a
# kernel (nnx.LinearGeneral flattens `[D, N, H]` to `[D, N·H]` first), as the Flax examples' Dense
# and DenseGeneral layers do.
KERNEL_INITS = {
    'lecun_normal': nnx.initializers.lecun_normal,  # truncated normal, var 1/fan_in (the default)
    'xavier_uniform': nnx.initializers.xavier_uniform,  # var 2/(fan_in + fan_out): Flax lm1b/wmt
}


def kernel_init(cfg):
  """The initialiser `config.model.kernel_init` names (lecun_normal when the field is absent)."""
  name = cfg.get('kernel_init', 'lecun_normal')
  return options.lookup('model.kernel_init', KERNEL_INITS, name)()


def attention_bias(cfg):
  """Biases in the attention projections: `model.attention_bias`, or `model.use_bias` (both)."""
  return bool(cfg.get('use_bias', False) or cfg.get('attention_bias', False))


def ffn_bias(cfg):
  """Biases in the feed-forward projections: `model.ffn_bias`, or `model.use_bias` (both)."""
  return bool(cfg.get('use_bias', False) or cfg.get('ffn_bias', False))


def head_dim(cfg):
  """H, each head's width: `model.head_dim`, or d_model / num_heads when it is 0 (the default)."""
  return cfg.get('head_dim', 0) or cfg.d_model // cfg.num_heads
