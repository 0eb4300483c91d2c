"""Position-wise feed-forward networks, keyed by `config.model.ffn`."""

import jax
from flax import nnx


class FeedForward(nnx.Module):
  """D -> F -> D with an activation: 2·D·F weights (8·D² for F = 4·D, about 2/3 of a layer)."""

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, rngs):
    self.activation = activation
    self.wi = nnx.Linear(d_model, d_ff, use_bias=use_bias, rngs=rngs)
    self.wo = nnx.Linear(d_ff, d_model, use_bias=use_bias, rngs=rngs)

  def __call__(self, x):
    return self.wo(self.activation(self.wi(x)))  # [B, T, D]


class GatedFeedForward(nnx.Module):
  """GLU family (Shazeer 2020): act(x W_gate) * (x W_up) W_down, 3·D·F weights."""

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, rngs):
    self.activation = activation
    self.gate = nnx.Linear(d_model, d_ff, use_bias=use_bias, rngs=rngs)
    self.up = nnx.Linear(d_model, d_ff, use_bias=use_bias, rngs=rngs)
    self.down = nnx.Linear(d_ff, d_model, use_bias=use_bias, rngs=rngs)

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
