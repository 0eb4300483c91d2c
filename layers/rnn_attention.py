"""RNN encoder-decoder attention: Bahdanau (additive), Luong (multiplicative), none."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers import options


def _masked_softmax(scores, mask):
  """Softmax over S of `[B, S]` scores; hidden (mask False) entries get probability 0."""
  if mask is not None:
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores.astype(jnp.float32), axis=-1)


class Bahdanau(nnx.Module, options.Configurable):
  """score(s, h) = v^T tanh(W_s s + W_h h) (Bahdanau et al. 2015)."""

  def __init__(self, d_query, d_memory, d_attention, *, scale=True, rngs):
    del scale
    self.w_query = nnx.Linear(d_query, d_attention, use_bias=False, rngs=rngs)
    self.w_memory = nnx.Linear(d_memory, d_attention, use_bias=True, rngs=rngs)
    self.v = nnx.Linear(d_attention, 1, use_bias=False, rngs=rngs)

  def prepare(self, memory):
    """W_h h for every source position, once per source: `[B, S, A]`."""
    return self.w_memory(memory)

  def __call__(self, query, keys, memory, mask=None):
    """Args: query `[B, Dq]`, keys from `prepare`, memory `[B, S, Dm]`, mask `[B, S]` (True = real).

    Returns:
      (context `[B, Dm]`, weights `[B, S]`).
    """
    scores = self.v(jnp.tanh(keys + self.w_query(query)[:, None, :]))[..., 0]  # [B, S]
    weights = _masked_softmax(scores, mask)
    return jnp.einsum('BS,BSD->BD', weights, memory), weights


class Luong(nnx.Module, options.Configurable):
  """score(s, h) = s^T W h (Luong et al. 2015, "general"), optionally over sqrt(d).

  With unit-variance components, s^T W h has variance ~d; the 1/sqrt(d) scale (as in Transformer
  attention) keeps the softmax out of saturation at initialisation.
  """

  options = ('rnn_luong_scale',)

  @classmethod
  def check_options(cls, model_cfg):
    options.boolean('model.rnn_luong_scale', model_cfg.rnn_luong_scale)

  def __init__(self, d_query, d_memory, d_attention, *, scale=True, rngs):
    del d_attention
    self.w = nnx.Linear(d_memory, d_query, use_bias=False, rngs=rngs)
    self.scale = 1.0 / math.sqrt(d_query) if scale else 1.0

  def prepare(self, memory):
    """W h for every source position: `[B, S, Dq]`."""
    return self.w(memory)

  def __call__(self, query, keys, memory, mask=None):
    scores = jnp.einsum('BD,BSD->BS', query, keys) * self.scale  # [B, S]
    weights = _masked_softmax(scores, mask)
    return jnp.einsum('BS,BSD->BD', weights, memory), weights


class NoAttention(nnx.Module, options.Configurable):
  """No attention: the context is the encoder's final state, a fixed-size bottleneck (Sutskever et
  al. 2014) that the decoder sees at every step."""

  def __init__(self, d_query, d_memory, d_attention, *, scale=True, rngs):
    del d_query, d_memory, d_attention, scale, rngs

  def prepare(self, memory):
    return memory

  def __call__(self, query, keys, memory, mask=None):
    """`memory` here is the final encoder state `[B, Dm]`; the weights are empty `[B, 0]`."""
    del query, keys, mask
    return memory, jnp.zeros(memory.shape[:1] + (0,), jnp.float32)


# RNN attention, keyed by `config.model.rnn_attention`.
RNN_ATTENTIONS = {
    'bahdanau': Bahdanau,
    'luong': Luong,
    'none': NoAttention,
}


def make(name, d_query, d_memory, d_attention, *, scale=True, rngs):
  """Builds the RNN attention `name` (a key of RNN_ATTENTIONS)."""
  return options.lookup('model.rnn_attention', RNN_ATTENTIONS, name)(
      d_query, d_memory, d_attention, scale=scale, rngs=rngs)
