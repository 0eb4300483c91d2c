"""What attention does per head around its core: the output gate and QK-norm."""

import jax
import jax.numpy as jnp
from flax import nnx

from layers import options
from layers import sharding

# `config.model.attention_gate`: a query-dependent sigmoid gate on each head's output before the
# output projection (Qiu et al. 2025, "Gated Attention for Large Language Models", position G1):
# one scalar per head (headwise, D -> N) or one per head dimension (elementwise, D -> N·H).
GATES = ('none', 'headwise', 'elementwise')
# `config.model.qk_norm`: RMSNorm of each head's query and key over H, with a learned scale of H
# shared by the heads (Qwen3, Gemma 3), applied after the projections and before RoPE rotates them.
QK_NORMS = ('none', 'rmsnorm')
EPSILON = 1e-6  # QK-norm's default epsilon: `model.norm_eps`'s, as the residual stream's norms


def layer_options(cfg):
  """The keyword arguments of `layers.attention.Attention` for these options and for the output
  projection's bias (`model.attention_out_bias`), from `config.model`: a variant with its own
  `from_config` passes them on. QK-norm's epsilon is `model.norm_eps`."""
  return {'gate': cfg.get('attention_gate', 'none'), 'qk_norm': cfg.get('qk_norm', 'none'),
          'qk_norm_eps': float(cfg.get('norm_eps', EPSILON)),
          'out_bias': bool(cfg.get('attention_out_bias', True))}


def check_options(model_cfg):
  """`model.attention_gate` and `model.qk_norm` name one of their choices."""
  options.choice('model.attention_gate', model_cfg.get('attention_gate', 'none'), GATES)
  options.choice('model.qk_norm', model_cfg.get('qk_norm', 'none'), QK_NORMS)


def gate_width(cfg, num_heads, head_dim):
  """The gates per token: 0, N (headwise) or N·H (elementwise); the gate's kernel is D x this."""
  return {'none': 0, 'headwise': num_heads, 'elementwise': num_heads * head_dim}[
      cfg.get('attention_gate', 'none')]


def param_count(cfg, d_model, num_heads, head_dim, *, use_bias):
  """The gate's D·N (headwise) or D·N·H (elementwise) weights (+ one bias per gate with the
  attention biases) and QK-norm's two scales of H."""
  width = gate_width(cfg, num_heads, head_dim)
  gate = d_model * width + (width if use_bias else 0)
  return gate + (2 * head_dim if cfg.get('qk_norm', 'none') == 'rmsnorm' else 0)


class OutputGate(nnx.Module):
  """Y ⊙ sigmoid(X W_θ): the heads' output Y gated by the layer's input X (the queries' input).

  Qwen's reference implementation computes X W_θ as extra columns of the query projection, so the
  gate has a bias exactly when the q/k/v/o projections do; here it is its own projection, which
  is the same function (and the same initialiser).
  """

  def __init__(self, d_model, num_heads, head_dim, kind, *, use_bias, kernel_init, rngs):
    options.choice('model.attention_gate', kind, GATES[1:])
    self.elementwise = kind == 'elementwise'
    shape, names = (((num_heads, head_dim), ('heads', 'head_dim')) if self.elementwise
                    else ((num_heads,), ('heads',)))
    self.proj = nnx.LinearGeneral(
        d_model, shape, use_bias=use_bias, rngs=rngs,
        kernel_init=sharding.partitioned(kernel_init, 'embed', *names),
        bias_init=sharding.partitioned(nnx.initializers.zeros, *names))

  def __call__(self, y, x):
    """Args:
      y: `[B, T, N, H]` the heads' attention output.
      x: `[B, T, D]` the attention layer's input (after the block's norm under Pre-LN).

    Returns:
      `[B, T, N, H]`.
    """
    gate = jax.nn.sigmoid(self.proj(x).astype(jnp.float32))  # [B, T, N, H] or [B, T, N]
    if not self.elementwise:
      gate = gate[..., None]  # [B, T, N, 1]: one scalar per head
    return (y.astype(jnp.float32) * gate).astype(y.dtype)


class QKNorm(nnx.Module):
  """RMSNorm over H of each head's query and key, `t / sqrt(mean(t²) + eps) · scale`, one learned
  scale `[H]` for the queries and one for the keys, shared by the heads; eps is `model.norm_eps`."""

  def __init__(self, head_dim, kind='rmsnorm', *, eps=EPSILON, rngs):
    options.choice('model.qk_norm', kind, QK_NORMS[1:])
    del rngs  # initialised to ones
    self.eps = float(eps)
    self.query_scale = nnx.Param(jnp.ones((head_dim,), jnp.float32), logical_axes=('head_dim',))
    self.key_scale = nnx.Param(jnp.ones((head_dim,), jnp.float32), logical_axes=('head_dim',))

  def _rms_norm(self, t, scale):
    t32 = t.astype(jnp.float32)  # the mean square in float32 whatever the activations' dtype
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(t32), -1, keepdims=True) + self.eps)  # [B, T, N, 1]
    return (t32 * inv * scale[...].astype(jnp.float32)).astype(t.dtype)

  def __call__(self, q, k):
    """q `[B, T, N, H]`, k `[B, S, K, H]` (either may be None, returned as is) -> normalised."""
    return (None if q is None else self._rms_norm(q, self.query_scale),
            None if k is None else self._rms_norm(k, self.key_scale))


def make(cfg_gate, cfg_qk_norm, d_model, num_heads, head_dim, *, use_bias, kernel_init, rngs,
         eps=EPSILON):
  """(OutputGate or None, QKNorm or None) for the choices `cfg_gate`, `cfg_qk_norm` ('none': None,
  so a layer without them holds exactly the parameters it held before they existed); `eps` is
  QK-norm's epsilon."""
  gate = (None if cfg_gate == 'none' else OutputGate(
      d_model, num_heads, head_dim, cfg_gate, use_bias=use_bias, kernel_init=kernel_init,
      rngs=rngs))
  norm = None if cfg_qk_norm == 'none' else QKNorm(head_dim, cfg_qk_norm, eps=eps, rngs=rngs)
  return gate, norm
