"""Normalisation layers, keyed by `config.model.norm`."""

from flax import nnx

from layers import options
from layers import sharding

EPSILON = 1e-6  # `config.model.norm_eps`'s default: every norm of the stacks, and QK-norm's


class _Options(options.Configurable):
  """The option every norm reads: `model.norm_eps`."""

  options = ('norm_eps',)

  @classmethod
  def check_options(cls, model_cfg):
    """`model.norm_eps` a positive finite number."""
    options.positive('model.norm_eps', model_cfg.get('norm_eps', EPSILON))


class LayerNorm(nnx.LayerNorm, _Options):
  """LayerNorm: subtract the mean, divide by the standard deviation, learned scale and shift."""

  def __init__(self, d_model, *, epsilon=EPSILON, rngs):
    super().__init__(d_model, epsilon=epsilon, rngs=rngs,
                     scale_init=sharding.partitioned(nnx.initializers.ones, 'embed'),
                     bias_init=sharding.partitioned(nnx.initializers.zeros, 'embed'))


class RMSNorm(nnx.RMSNorm, _Options):
  """RMSNorm: divide by the root mean square only (no centring, no shift), as in T5 and LLaMA."""

  def __init__(self, d_model, *, epsilon=EPSILON, rngs):
    super().__init__(d_model, epsilon=epsilon, rngs=rngs,
                     scale_init=sharding.partitioned(nnx.initializers.ones, 'embed'))


# `NORMS[name](d_model, epsilon=, rngs=)` builds the norm; both read `model.norm_eps` (`make`).
NORMS = {
    'layernorm': LayerNorm,
    'rmsnorm': RMSNorm,
}


def make(cfg, d_model, *, rngs):
  """The norm `cfg.norm` of width `d_model` with epsilon `cfg.norm_eps` (1e-6 when absent)."""
  cls = options.lookup('model.norm', NORMS, cfg.norm)
  return cls(d_model, epsilon=float(cfg.get('norm_eps', EPSILON)), rngs=rngs)
