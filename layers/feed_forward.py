"""Position-wise feed-forward networks, keyed by `config.model.ffn`."""

from typing import Callable, NamedTuple

import jax
from flax import nnx

from layers import options
from layers import sharding


def _linear(d_in, d_out, names, use_bias, rngs):
  """nnx.Linear (its default init) whose kernel and bias carry logical axis names."""
  return nnx.Linear(d_in, d_out, use_bias=use_bias, rngs=rngs,
                    kernel_init=sharding.partitioned(nnx.nn.linear.default_kernel_init, *names),
                    bias_init=sharding.partitioned(nnx.initializers.zeros, names[1]))


class FeedForward(nnx.Module, options.Configurable):
  """D -> F -> D with an activation: 2·D·F weights (8·D² for F = 4·D, about 2/3 of a layer)."""

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, rngs):
    self.activation = activation
    self.wi = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs)
    self.wo = _linear(d_ff, d_model, ('mlp', 'embed'), use_bias, rngs)

  def __call__(self, x):
    return self.wo(self.activation(self.wi(x)))  # [B, T, D]


class GatedFeedForward(nnx.Module, options.Configurable):
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


class FFN(NamedTuple):
  """A registered feed-forward network: its module class and activation, whose options and checks
  (layers.options.Configurable) are the module class's."""

  module: type
  activation: Callable

  @property
  def options(self):
    return self.module.options

  def check_options(self, model_cfg):
    self.module.check_options(model_cfg)

  def check_config(self, model_cfg, data_cfg):
    self.module.check_config(model_cfg, data_cfg)


FFNS = {
    'relu': FFN(FeedForward, jax.nn.relu),
    'gelu': FFN(FeedForward, _gelu),
    'swiglu': FFN(GatedFeedForward, jax.nn.silu),
    'geglu': FFN(GatedFeedForward, _gelu),
}


def make(name, d_model, d_ff, *, use_bias=False, rngs):
  """Builds the feed-forward network `name` (a key of FFNS)."""
  cls, act = options.lookup('model.ffn', FFNS, name)
  return cls(d_model, d_ff, act, use_bias=use_bias, rngs=rngs)
