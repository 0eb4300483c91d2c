"""Normalisation layers, keyed by `config.model.norm`."""

from flax import nnx

from layers import options
from layers import sharding


class LayerNorm(nnx.LayerNorm, options.Configurable):
  """LayerNorm: subtract the mean, divide by the standard deviation, learned scale and shift."""

  def __init__(self, d_model, *, rngs):
    super().__init__(d_model, epsilon=1e-6, rngs=rngs,
                     scale_init=sharding.partitioned(nnx.initializers.ones, 'embed'),
                     bias_init=sharding.partitioned(nnx.initializers.zeros, 'embed'))


class RMSNorm(nnx.RMSNorm, options.Configurable):
  """RMSNorm: divide by the root mean square only (no centring, no shift), as in T5 and LLaMA."""

  def __init__(self, d_model, *, rngs):
    super().__init__(d_model, epsilon=1e-6, rngs=rngs,
                     scale_init=sharding.partitioned(nnx.initializers.ones, 'embed'))


# `NORMS[name](d_model, rngs=)` builds the norm; neither reads an option of its own.
NORMS = {
    'layernorm': LayerNorm,
    'rmsnorm': RMSNorm,
}
