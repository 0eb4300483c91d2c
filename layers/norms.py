"""Normalisation layers, keyed by `config.model.norm`."""

from flax import nnx

from layers import sharding


def layer_norm(d_model, *, rngs):
  """LayerNorm: subtract the mean, divide by the standard deviation, learned scale and shift."""
  return nnx.LayerNorm(d_model, epsilon=1e-6, rngs=rngs,
                       scale_init=sharding.partitioned(nnx.initializers.ones, 'embed'),
                       bias_init=sharding.partitioned(nnx.initializers.zeros, 'embed'))


def rms_norm(d_model, *, rngs):
  """RMSNorm: divide by the root mean square only (no centring, no shift), as in T5 and LLaMA."""
  return nnx.RMSNorm(d_model, epsilon=1e-6, rngs=rngs,
                     scale_init=sharding.partitioned(nnx.initializers.ones, 'embed'))


NORMS = {
    'layernorm': layer_norm,
    'rmsnorm': rms_norm,
}
