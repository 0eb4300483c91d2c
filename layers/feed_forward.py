"""Position-wise feed-forward networks, keyed by `config.model.ffn`."""

import jax
from flax import nnx

from layers import sharding


def _linear(d_in, d_out, names, use_bias, rngs):
  """nnx.Linear (its default init) whose kernel and bias carry logical axis names."""
  return nnx.Linear(d_in, d_out, use_bias=use_bias, rngs=rngs,
                    kernel_init=sharding.partitioned(nnx.nn.linear.default_kernel_init, *names),
                    bias_init=sharding.partitioned(nnx.initializers.zeros, names[1]))


class FeedForward(nnx.Module):
  """D -> F -> D with an activation: 2·D·F weights (8·D² for F = 4·D, about 2/3 of a layer)."""

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, rngs):
    self.activation = activation
    self.wi = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs)
    self.wo = _linear(d_ff, d_model, ('mlp', 'embed'), use_bias, rngs)

  def __call__(self, x):
    return self.wo(self.activation(self.wi(x)))  # [B, T, D]


class GatedFeedForward(nnx.Module):
  """GLU family (Shazeer 2020): act(x W_gate) * (x W_up) W_down, 3·D·F weights."""

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, rngs):
    self.activation = activation
    self.gate = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs)
    self.up = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs)
    self.down = _linear(d_ff, d_model, ('mlp', 'embed'), use_bias, rngs)

  def __call__(self, x):
    return self.down(self.activation(self.gate(x)) * self.up(x))  # [B, T, D]


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)


# name -> (module class, activation)
FFNS = {
    'relu': (FeedForward, jax.nn.relu),
    'gelu': (FeedForward, _gelu),
    'swiglu': (GatedFeedForward, jax.nn.silu),
    'geglu': (GatedFeedForward, _gelu),
}


def make(name, d_model, d_ff, *, use_bias=False, rngs):
  """Builds the feed-forward network `name` (a key of FFNS)."""
  if name not in FFNS:
    raise ValueError(f'ffn {name!r} unknown; valid: {sorted(FFNS)}')
  cls, act = FFNS[name]
  return cls(d_model, d_ff, act, use_bias=use_bias, rngs=rngs)
