"""Differential attention (Ye et al. 2024): the difference of two softmax maps per head."""

import math

import jax.numpy as jnp
from flax import nnx

from layers import attention
from layers import initializers
from layers import options
from layers import sharding

# The init of the lambda vectors and the epsilon of the per-head RMSNorm, as in the paper's
# official code (microsoft/unilm, Diff-Transformer/multihead_diffattn.py).
LAMBDA_STD = 0.1
HEAD_NORM_EPS = 1e-5


def lambda_init(layer):
  """lambda_init = 0.8 - 0.6·exp(-0.3·(l - 1)) at depth l = `layer` + 1 (Ye et al. 2024, Sec. 2.1):
  0.2 in the first layer, rising towards 0.8 with depth.

  Args:
    layer: the block's 0-based index in its stack.
  """
  return 0.8 - 0.6 * math.exp(-0.3 * layer)


class DifferentialAttention(attention.Attention):
  """Differential attention: per head, (softmax(Q1 K1ᵀ/√d) - λ·softmax(Q2 K2ᵀ/√d)) V.

  The difference of two softmax maps cancels the attention both give to irrelevant context (the
  paper's "attention noise"), as a differential amplifier cancels common-mode noise. λ is a
  learned scalar per layer, reparameterised as λ = exp(λ_q1·λ_k1) - exp(λ_q2·λ_k2) + λ_init with
  four learned `[d]` vectors (init N(0, 0.1²)) and λ_init = `lambda_init(layer)` by depth. Each
  head's output goes through an RMSNorm over its 2d values (the paper's headwise GroupNorm; one
  scale shared by the heads, as in the official code), times (1 - λ_init), before the output
  projection.

  Heads, as in the paper and its code: `num_heads` N counts softmax maps, N/2 differential heads
  of two maps each. Map width d = H (the head_dim of the dense layer at the same N), each
  differential head's value is 2H wide. So the q/k/v/o projections are exactly the dense layer's
  (D·N·H + 2·D·K·H + N·H·D), the position methods act on heads of the width they were built for
  (RoPE's frequencies of d, one ALiBi slope or T5 column per map), and the dense KV cache of K
  heads of width H serves the cached step unchanged. The paper compares a Transformer of 2h heads
  with a differential one of h heads: that is this layer at the same `num_heads` = 2h. N and K
  must be even (`head_multiple`).

  Layout: the two maps of differential head n are query heads n and N/2 + n (Q1, Q2), their keys
  KV heads m and K/2 + m (K1, K2) with m = n // (N/K), and its value the 2H values of KV heads m
  and K/2 + m side by side: with the maps of each kind in one block, a kernel's grouping of query
  head i onto KV head i // (N/K) pairs Q1 with K1 and Q2 with K2 under GQA too.

  The N maps run in one call of `dot_product_attention` (every kernel); for a kernel whose row
  does not declare `value_width` (one head width: the flash kernels), q and k are zero-padded to
  2H, the value's width (the zeros add nothing to the scores; the scale stays 1/√H).
  `has_scores`: each map is a softmax over its own q/k scores; `score_stats` and `weights`
  describe the N maps, `differential_weights` their differences.
  """

  takes_layer = True
  head_multiple = 2
  scannable = False  # λ_init is a constant of each layer's depth; scanned layers share one trace
  param_form = 'D·N·H + 2·D·K·H + N·H·D + 6·H (λ vectors, head norm)'

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, layer=0, rngs, **kwargs):
    """Args:
      d_model, num_heads, num_kv_heads: D, N maps (N/2 differential heads), K KV heads; N and K
        even.
      layer: the block's 0-based index in its stack (λ_init).
      rngs: parameter initialisation.
      **kwargs: those of `layers.attention.Attention` (head_dim, use_bias, implementation, ...).
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % 2 or num_kv_heads % 2:
      raise ValueError(f'differential attention needs an even num_heads ({num_heads}) and '
                       f'num_kv_heads ({num_kv_heads}): each head is a pair of softmax maps')
    super().__init__(d_model, num_heads, num_kv_heads, rngs=rngs, **kwargs)
    self.layer = layer
    self.lambda_init = lambda_init(layer)
    h = self.head_dim
    normal = nnx.initializers.normal(LAMBDA_STD)

    def vector():  # [H]
      return nnx.Param(normal(rngs.params(), (h,), jnp.float32), logical_axes=('head_dim',))

    self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (vector() for _ in range(4))
    self.head_norm = nnx.RMSNorm(2 * h, epsilon=HEAD_NORM_EPS, rngs=rngs, scale_init=(
        sharding.partitioned(nnx.initializers.ones, 'head_dim')))

  @classmethod
  def from_config(cls, cfg, *, rngs, layer=None):
    """As dense's (every option of `Attention.from_config`), plus `layer` (None: 0, the first
    layer's λ_init)."""
    return super().from_config(cfg, rngs=rngs, layer=0 if layer is None else layer)

  @classmethod
  def param_count(cls, cfg):
    """Dense's projections, the four λ vectors `[H]` and the head norm's scale `[2H]`."""
    return super().param_count(cfg) + 6 * initializers.head_dim(cfg)

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """Even `model.num_heads` and `model.num_kv_heads`; the projection options are taken (its
    `from_config` passes them on as dense's does, so dense's check applies, not a variant's)."""
    attention.Attention.check_config(model_cfg, data_cfg)
    m = model_cfg
    for name in ('num_heads', 'num_kv_heads'):
      if m[name] % cls.head_multiple:
        raise options.ConfigError(
            f'model.{name}={m[name]} must be even for model.attention={m.attention!r} (each '
            'differential head is a pair of softmax maps); valid values: 2, 4, 6, ...')

  def lam(self):
    """λ = exp(λ_q1·λ_k1) - exp(λ_q2·λ_k2) + λ_init, a float32 scalar."""
    dot = lambda a, b: jnp.sum(a[...] * b[...])
    return (jnp.exp(dot(self.lambda_q1, self.lambda_k1))
            - jnp.exp(dot(self.lambda_q2, self.lambda_k2)) + self.lambda_init)

  def attend(self, q, k, v, terms, *, segment_ids=None, is_causal=False, window=None,
             implementation='xla', dropout_rng=None):
    """The N maps of prepared q `[B, T, N, H]`, k, v `[B, S, K, H]` with `terms` through the kernel
    `implementation`, then `combine`. `__call__` and the dense cached step both end here.

    Returns:
      `[B, T, N, H]`, the output projection's input.
    """
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    # KV head m's value is that of heads m and K/2 + m side by side; heads m and K/2 + m (its K1
    # and K2) both carry it, so Q1's and Q2's maps weigh the same 2H-wide value.
    value = v.reshape(b, s, 2, kv // 2, h).transpose(0, 1, 3, 2, 4).reshape(
        b, s, kv // 2, 2 * h)  # [B, S, K/2, 2H]
    value = jnp.concatenate([value, value], axis=2)  # [B, S, K, 2H]
    if not attention.KERNELS[implementation].value_width:
      # q and k zero-padded to the value's width for a kernel of one head width: the zeros add
      # nothing to the scores, and the scale below stays 1/sqrt(H).
      pad = [(0, 0), (0, 0), (0, 0), (0, h)]
      q, k = jnp.pad(q, pad), jnp.pad(k, pad)  # [B, T, N, 2H], [B, S, K, 2H]
    rate = self.dropout_rate if dropout_rng is not None else 0.0
    out = attention.dot_product_attention(
        q, k, value, segment_ids=segment_ids, is_causal=is_causal,
        scale=self.score_scale(h), local_window_size=window, implementation=implementation,
        dropout_rate=rate, dropout_rng=dropout_rng, **terms.kwargs())  # [B, T, N, 2H]
    return self.combine(out).astype(v.dtype)

  def combine(self, out):
    """Each differential head's output from its two maps' `out` `[B, T, N, 2H]`: (O1 - λ·O2),
    normalised per head and scaled by (1 - λ_init), its 2H values laid out over query heads n and
    N/2 + n for the output projection: `[B, T, N, H]` (float32)."""
    b, t, n, h2 = out.shape
    out = out.astype(jnp.float32)
    diff = out[:, :, :n // 2] - self.lam() * out[:, :, n // 2:]  # [B, T, N/2, 2H]
    # The norm keeps each head's scale fixed while λ moves; (1 - λ_init) matches the gradient
    # flow to the dense layer's at initialisation (the paper's Appendix on gradients).
    diff = self.head_norm(diff) * (1.0 - self.lambda_init)  # [B, T, N/2, 2H]
    return diff.reshape(b, t, n // 2, 2, h2 // 2).transpose(0, 1, 3, 2, 4).reshape(
        b, t, n, h2 // 2)  # [B, T, N, H]

  def differential_weights(self, x, **kwargs):
    """The `[B, N/2, T, S]` differential maps softmax(Q1 K1ᵀ/√d) - λ·softmax(Q2 K2ᵀ/√d) of
    `__call__` with the same arguments (`weights`' keywords); a row sums to 1 - λ and may be
    negative."""
    probs = self.weights(x, **kwargs)  # [B, N, T, S]
    n = probs.shape[1]
    return probs[:, :n // 2] - self.lam() * probs[:, n // 2:]
