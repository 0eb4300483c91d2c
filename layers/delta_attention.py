"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464): a causal recurrent layer."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers import attention as attention_lib
from layers import delta_rule
from layers import initializers
from layers import options
from layers import sharding

# The output norm's epsilon (fla's FusedRMSNormGated default).
NORM_EPS = 1e-5
# Mamba2's initial ranges: A ~ U[1, 16] (fla draws U[0, 16]; 1 keeps log A finite), the step
# dt log-uniform in [1e-3, 0.1] (floored at 1e-4) with dt_bias = softplus⁻¹(dt).
A_RANGE = (1.0, 16.0)
DT_RANGE = (1e-3, 0.1)
DT_FLOOR = 1e-4
# Position methods that scale q and k per position (xPos's decay), refused by `check_config`.
SCALING_POSITIONS = ('xpos',)


def _dt_bias_init(key, shape):
  """softplus⁻¹ of a log-uniform step in `DT_RANGE`: softplus(dt_bias) starts at dt."""
  lo, hi = math.log(DT_RANGE[0]), math.log(DT_RANGE[1])
  dt = jnp.maximum(jnp.exp(jax.random.uniform(key, shape, jnp.float32, lo, hi)), DT_FLOOR)
  return dt + jnp.log(-jnp.expm1(-dt))


def _positive_int(name, value):
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise options.ConfigError(f'{name}={value!r} must be a positive integer; valid values: 1, 2, '
                              '3, ...')


class GatedDeltaNetAttention(attention_lib.Attention):
  """Gated DeltaNet as an attention variant: per state head a `[H, H]` memory updated by the
  gated delta rule (layers/delta_rule.py), read by the queries. Causal only.

  As flash-linear-attention's `GatedDeltaNet` layer (fla/layers/gated_deltanet.py), with:
    - widths from the config: N query heads and K key/value heads of width H = `head_dim`
      (d_model / N by default); the value width is H too (the paper's expand_v = 1; fla's
      default 2 would widen v, the gate and the output projection). With K < N (GQA) each of
      the K states is read by G = N / K query heads; β and the decay are per state head (K).
    - q, k, v: the base projections (biases with `attention_bias`/`use_bias`), each through a
      causal depthwise convolution of width `model.deltanet_conv` (4) and SiLU, without bias;
      then the position's rotation (rope; nope, sinusoidal and learned act outside), then q and k
      L2-normalised per head (eps 1e-6 under the square root) and q scaled by 1/sqrt(H) (fla's
      default scale; 1 with `model.unscaled`).
    - β = sigmoid(W_b x), the decay α = exp(g), g = -exp(A_log)·softplus(W_a x + dt_bias)
      (Mamba2's; W_a, W_b `[D, K]` without bias; A_log, dt_bias `[K]`, initialised as
      `A_RANGE`, `DT_RANGE`; AdamW's weight decay reaches them as every parameter, where fla
      exempts them).
    - the output o = RMSNorm(o) ⊙ SiLU(W_g x) per head (one `[H]` scale shared by the heads,
      eps 1e-5; W_g `[D, N, H]` without bias), then the output projection.
    - training: `delta_rule.chunked` with chunks of `model.deltanet_chunk` (64) tokens;
      decoding: `delta_rule.recurrent_step`, the cache holding the last W-1 projections of
      q, k, v (the convolutions' inputs) and the state S `[B, K, H, H]`, constant in the length.
    - packed segments (and padding, segment 0) stay apart: the state restarts from zero at each
      segment start (the decay across it is 0, as if α were 0 there) and the convolutions take no
      input from another segment.
  """

  name = 'gated_deltanet'
  # A recurrence, not a softmax over [T, S] scores: no kernel, no score terms (positions that add
  # them are refused), no scores for the diagnostics; its own cached step (the state).
  has_scores = False
  takes_score_terms = False
  uses_kernel = False  # model.attention_impl does not apply
  supports_causal = True
  supports_bidirectional = False  # a recurrence over the past: validation keeps it out of encoders
  supports_segments = True  # the state restarts at each segment start
  scannable = True
  cached_decoding = 'own'
  has_paged_cache = False
  gates_output = False  # it has its own output gate, RMSNorm(o)·SiLU(W_g x): no second one
  norms_qk = False  # q and k are L2-normalised already
  layer_terms = ()  # no softmax: no logit soft cap, no sinks
  options = ('use_bias', 'unscaled', 'head_dim', 'attention_bias', 'attention_out_bias',
             'kernel_init', 'deltanet_conv', 'deltanet_chunk')

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, conv=4, chunk=64, head_dim=None,
               use_bias=False, scale=None, kernel_init=None, out_bias=True, rngs):
    """Args: as `Attention`, plus `conv` (W, the convolutions' width) and `chunk` (the training
    form's chunk length)."""
    super().__init__(d_model, num_heads, num_kv_heads, head_dim=head_dim, use_bias=use_bias,
                     scale=scale, kernel_init=kernel_init, out_bias=out_bias, rngs=rngs)
    n, kh, h = self.num_heads, self.num_kv_heads, self.head_dim
    self.conv, self.chunk = int(conv), int(chunk)
    init = nnx.initializers.lecun_normal() if kernel_init is None else kernel_init

    def proj(d_out, names):
      return nnx.LinearGeneral(d_model, d_out, use_bias=False, rngs=rngs,
                               kernel_init=sharding.partitioned(init, *names))

    self.gate_proj = proj((n, h), ('embed', 'heads', 'head_dim'))  # W_g
    self.decay_proj = proj(kh, ('embed', 'kv_heads'))  # W_a
    self.beta_proj = proj(kh, ('embed', 'kv_heads'))  # W_b
    self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (kh,), jnp.float32,
                                                      *A_RANGE)), logical_axes=('kv_heads',))
    self.dt_bias = nnx.Param(_dt_bias_init(rngs.params(), (kh,)), logical_axes=('kv_heads',))
    # PyTorch's Conv1d default for a depthwise kernel (fan-in W): U(-1/sqrt(W), 1/sqrt(W)).
    bound = 1.0 / math.sqrt(self.conv)

    def conv_param(heads, name):
      return nnx.Param(jax.random.uniform(rngs.params(), (self.conv, heads, h), jnp.float32,
                                          -bound, bound), logical_axes=(None, name, 'head_dim'))

    self.conv_q = conv_param(n, 'heads')  # [W, N, H]
    self.conv_k = conv_param(kh, 'kv_heads')  # [W, K, H]
    self.conv_v = conv_param(kh, 'kv_heads')  # [W, K, H]
    self.out_norm = nnx.Param(jnp.ones((h,), jnp.float32), logical_axes=('head_dim',))

  @classmethod
  def from_config(cls, cfg, *, rngs):
    """From `config.model`: sizes, head_dim, attention_bias (or use_bias), unscaled, kernel_init,
    deltanet_conv, deltanet_chunk."""
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, conv=cfg.deltanet_conv,
               chunk=cfg.deltanet_chunk, head_dim=initializers.head_dim(cfg),
               use_bias=initializers.attention_bias(cfg),
               scale=1.0 if cfg.get('unscaled', False) else None,
               kernel_init=initializers.kernel_init(cfg),
               out_bias=cfg.get('attention_out_bias', True), rngs=rngs)

  @classmethod
  def param_count(cls, cfg):
    """The q, k, v, o projections, W_g (D·N·H), W_a and W_b (2·D·K), A_log and dt_bias (2·K), the
    convolutions (W·(N + 2K)·H) and the output norm's scale (H)."""
    d, n, kh, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, initializers.head_dim(cfg)
    return (super().param_count(cfg) + d * n * h + 2 * d * kh + 2 * kh
            + cfg.deltanet_conv * (n + 2 * kh) * h + h)

  @classmethod
  def check_options(cls, model_cfg):
    """`model.deltanet_conv` and `model.deltanet_chunk`: positive integers."""
    _positive_int('model.deltanet_conv', model_cfg.get('deltanet_conv', 4))
    _positive_int('model.deltanet_chunk', model_cfg.get('deltanet_chunk', 64))

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """`model.unscaled`; no attention dropout (no weights to drop); a causal use only."""
    del data_cfg
    m = model_cfg
    options.boolean('model.unscaled', m.unscaled)
    cls.check_heads(m)
    if m.get('attention_dropout', 0.0) != 0.0:
      raise options.ConfigError(f'model.attention_dropout={m.attention_dropout!r} is not read by '
                                f'model.attention={cls.name!r} (no attention weights to drop); '
                                'valid value here: 0.0')
    if m.position in SCALING_POSITIONS:
      # Its decay is a per-position scale of q and k, which their L2 normalisation would bend
      # into a position-dependent change of direction instead of a decay of q·k.
      raise options.ConfigError(
          f'model.position={m.position!r} scales q and k, which the L2 normalisation of '
          f'model.attention={cls.name!r} undoes; valid values: learned, nope, rope, sinusoidal')

  # --- The layer ----------------------------------------------------------------------------------

  def _causal_only(self, context, is_causal):
    if context is not None or not is_causal:
      raise ValueError(f'attention={self.name!r} is causal self-attention only (is_causal=True, '
                       'no context); validation refuses an encoder use')

  def heads(self, x, q, k, v):
    """q `[B, T, K, G, H]` (L2-normalised, scaled), k `[B, T, K, H]` (L2-normalised), v, β and g
    `[B, T, K]` of the convolved (and rotated) projections and the layer's input x."""
    b, t = q.shape[:2]
    kh = self.num_kv_heads
    q = delta_rule.l2_normalise(q) * self.score_scale(self.head_dim)  # [B, T, N, H]
    q = q.reshape(b, t, kh, self.num_heads // kh, self.head_dim)
    k = delta_rule.l2_normalise(k)  # [B, T, K, H]
    beta = jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))  # [B, T, K]
    g = delta_rule.decay_log(self.decay_proj(x), self.a_log[...], self.dt_bias[...])  # [B, T, K]
    return q, k, v.astype(jnp.float32), beta, g

  def inputs(self, x, segment_ids, positions, position):
    """`heads` of the whole sequence x `[B, T, D]`; the convolutions stay within segments."""
    q, k, v = self.project(x)  # [B, T, N, H], [B, T, K, H], [B, T, K, H]
    q, _ = delta_rule.short_conv(q, self.conv_q[...], segment_ids=segment_ids)
    k, _ = delta_rule.short_conv(k, self.conv_k[...], segment_ids=segment_ids)
    v, _ = delta_rule.short_conv(v, self.conv_v[...], segment_ids=segment_ids)
    q, k = self.positions_without_scores(q, k, positions, position, True)
    return self.heads(x, q, k, v)

  def output(self, x, out):
    """RMSNorm(o) ⊙ SiLU(W_g x) per head, then the output projection: `[B, T, K, G, H]` ->
    `[B, T, D]`."""
    b, t = out.shape[:2]
    o = out.reshape(b, t, self.num_heads, self.head_dim)  # [B, T, N, H] float32
    o = o * jax.lax.rsqrt(jnp.mean(jnp.square(o), -1, keepdims=True) + NORM_EPS)
    o = o * self.out_norm[...].astype(jnp.float32)
    o = o * jax.nn.silu(self.gate_proj(x).astype(jnp.float32))  # [B, T, N, H]
    return self.out(o.astype(x.dtype))

  def __call__(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
               is_causal=False, positions=None, context_positions=None, position=None, rngs=None):
    """As `Attention.__call__`, causal self-attention only (no dropout: `rngs` is unused)."""
    del context_segment_ids, context_positions, rngs
    self._causal_only(context, is_causal)
    q, k, v, beta, g = self.inputs(x, segment_ids, positions, position)
    out, _ = delta_rule.chunked(q, k, v, beta, g, chunk=self.chunk,
                                segment_ids=segment_ids)  # [B, T, K, G, H]
    return self.output(x, out)

  def weights(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
              is_causal=False, positions=None, context_positions=None, position=None):
    """The `[B, N, T, T]` implied weights W with o = W v before the output norm and gate
    (`delta_rule.implied_weights`: signed, quadratic in T; for plots)."""
    del context_segment_ids, context_positions
    self._causal_only(context, is_causal)
    q, k, _, beta, g = self.inputs(x, segment_ids, positions, position)
    w = delta_rule.implied_weights(q, k, beta, g, segment_ids)  # [B, K, G, T, T]
    return w.reshape(w.shape[0], self.num_heads, *w.shape[-2:])

  # --- Recurrent decoding: the convolutions' inputs and the state are the cache -------------------

  def init_cache(self, batch_size, max_length, dtype=jnp.float32):
    """{'conv_q' `[B, W-1, N, H]`, 'conv_k', 'conv_v' `[B, W-1, K, H]` (in `dtype`): the last W-1
    projections; 'state' `[B, K, H, H]` float32}: zeros, constant in `max_length`."""
    del max_length
    n, kh, h, w = self.num_heads, self.num_kv_heads, self.head_dim, self.conv - 1
    return {'conv_q': jnp.zeros((batch_size, w, n, h), dtype),
            'conv_k': jnp.zeros((batch_size, w, kh, h), dtype),
            'conv_v': jnp.zeros((batch_size, w, kh, h), dtype),
            'state': jnp.zeros((batch_size, kh, h, h), jnp.float32)}

  def decode(self, x, cache, index, *, position=None):
    """One causal step of `x` `[B, 1, D]` at positions `index`: the convolutions take the cached
    inputs, the state one `delta_rule.recurrent_step`. Steps come in order, one position per call
    (as models.decoding feeds them). Returns (`[B, 1, D]`, the updated cache)."""
    b = x.shape[0]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))  # [B]
    q, k, v = self.project(x)  # [B, 1, N, H], [B, 1, K, H], [B, 1, K, H]
    q, conv_q = delta_rule.short_conv(q, self.conv_q[...], cache['conv_q'])
    k, conv_k = delta_rule.short_conv(k, self.conv_k[...], cache['conv_k'])
    v, conv_v = delta_rule.short_conv(v, self.conv_v[...], cache['conv_v'])
    q, k = self.positions_without_scores(q, k, index[:, None], position, True)
    q, k, v, beta, g = self.heads(x, q, k, v)
    out, state = delta_rule.recurrent_step(cache['state'], q[:, 0], k[:, 0], v[:, 0], beta[:, 0],
                                           g[:, 0])  # [B, K, G, H]
    dtype = cache['conv_q'].dtype
    return self.output(x, out[:, None]), {
        'conv_q': conv_q.astype(dtype), 'conv_k': conv_k.astype(dtype),
        'conv_v': conv_v.astype(dtype), 'state': state}
