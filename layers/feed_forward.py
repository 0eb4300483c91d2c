"""Position-wise feed-forward networks, keyed by `config.model.ffn`."""

from typing import Callable, NamedTuple

import jax
from flax import nnx

from layers import options
from layers import sharding


def _linear(d_in, d_out, names, use_bias, rngs, kernel_init=None):
  """nnx.Linear whose kernel and bias carry logical axis names; `kernel_init` None is nnx's
  default (lecun_normal)."""
  init = nnx.nn.linear.default_kernel_init if kernel_init is None else kernel_init
  return nnx.Linear(d_in, d_out, use_bias=use_bias, rngs=rngs,
                    kernel_init=sharding.partitioned(init, *names),
                    bias_init=sharding.partitioned(nnx.initializers.zeros, names[1]))


class _Options(options.Configurable):
  """The options every feed-forward network reads (through `make`)."""

  options = ('ffn_bias', 'ffn_dropout', 'kernel_init')

  @classmethod
  def check_options(cls, model_cfg):
    """`model.ffn_bias` a bool, `model.ffn_dropout` a rate in [0, 1)."""
    options.boolean('model.ffn_bias', model_cfg.get('ffn_bias', False))
    rate = model_cfg.get('ffn_dropout', 0.0)
    options.positive('model.ffn_dropout', rate, zero_ok=True)
    if rate >= 1:
      raise options.ConfigError(f'model.ffn_dropout={rate!r} must be in [0, 1)')


class FeedForward(nnx.Module, _Options):
  """D -> F -> D with an activation: 2·D·F weights (8·D² for F = 4·D, about 2/3 of a layer).

  `dropout` (model.ffn_dropout) acts on the F-wide activations, after the nonlinearity, as the
  Flax examples' MlpBlock does; the block's own dropout acts on the D-wide output.
  """

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, kernel_init=None, dropout=0.0,
               rngs):
    self.activation = activation
    self.wi = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs, kernel_init)
    self.wo = _linear(d_ff, d_model, ('mlp', 'embed'), use_bias, rngs, kernel_init)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, rngs=None):
    """`x` `[B, T, D]`; `rngs` with a `dropout` stream while training (None: no dropout)."""
    h = self.dropout(self.activation(self.wi(x)), deterministic=rngs is None, rngs=rngs)
    return self.wo(h)  # [B, T, D]


class GatedFeedForward(nnx.Module, _Options):
  """GLU family (Shazeer 2020): act(x W_gate) * (x W_up) W_down, 3·D·F weights; `dropout` on the
  gated product (the F-wide input of W_down)."""

  def __init__(self, d_model, d_ff, activation, *, use_bias=False, kernel_init=None, dropout=0.0,
               rngs):
    self.activation = activation
    self.gate = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs, kernel_init)
    self.up = _linear(d_model, d_ff, ('embed', 'mlp'), use_bias, rngs, kernel_init)
    self.down = _linear(d_ff, d_model, ('mlp', 'embed'), use_bias, rngs, kernel_init)
    self.dropout = nnx.Dropout(dropout)

  def __call__(self, x, rngs=None):
    """`x` `[B, T, D]`; `rngs` with a `dropout` stream while training (None: no dropout)."""
    h = self.activation(self.gate(x)) * self.up(x)  # [B, T, F]
    return self.down(self.dropout(h, deterministic=rngs is None, rngs=rngs))  # [B, T, D]


def _gelu(x):
  return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
  """GELU's tanh approximation, 0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³))): GPT-2's
  "gelu_new" (transformers' NewGELUActivation)."""
  return jax.nn.gelu(x, approximate=True)


class FFN(NamedTuple):
  """A registered feed-forward network: its module class and activation, whose options and checks
  (layers.options.Configurable) are the module class's."""

  module: type
  activation: Callable

  @property
  def options(self):
    return self.module.options

  def resolve_options(self, model_cfg, data_cfg):
    self.module.resolve_options(model_cfg, data_cfg)

  def check_options(self, model_cfg):
    self.module.check_options(model_cfg)

  def check_config(self, model_cfg, data_cfg):
    self.module.check_config(model_cfg, data_cfg)


FFNS = {
    'relu': FFN(FeedForward, jax.nn.relu),
    'gelu': FFN(FeedForward, _gelu),
    'gelu_tanh': FFN(FeedForward, _gelu_tanh),
    'swiglu': FFN(GatedFeedForward, jax.nn.silu),
    'geglu': FFN(GatedFeedForward, _gelu),
}


def make(name, d_model, d_ff, *, use_bias=False, kernel_init=None, dropout=0.0, rngs):
  """Builds the feed-forward network `name` (a key of FFNS); see FeedForward for the options."""
  cls, act = options.lookup('model.ffn', FFNS, name)
  return cls(d_model, d_ff, act, use_bias=use_bias, kernel_init=kernel_init, dropout=dropout,
             rngs=rngs)
