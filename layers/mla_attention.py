"""Multi-head latent attention (MLA, DeepSeek-V2 2024): keys and values from one cached latent."""

import jax.numpy as jnp
from flax import nnx

from layers import attention
from layers import attention_heads
from layers import contract
from layers import initializers
from layers import masks
from layers import options
from layers import positions as positions_lib
from layers import sharding

RMS_EPS = 1e-6  # DeepSeek-V2's RMSNorm epsilon on the latents


def rope_dim(cfg):
  """d_h^R, the decoupled rotary width per head: `model.mla_rope_dim`, or when it is 0, H/2
  rounded down to an even number (DeepSeek-V2: d_h^R = d_h / 2 = 64), at least 2, under a
  position that rotates any width (RoPE), and 0 (no rotary part) under any other."""
  explicit = cfg.get('mla_rope_dim', 0)
  if explicit:
    return explicit
  if not positions_lib.POSITIONS[cfg.position].rotates_any_width:
    return 0
  return max(2, 2 * (initializers.head_dim(cfg) // 4))


class MultiHeadLatentAttention(attention.Attention):
  """MLA (DeepSeek-V2, eqs. 9-19): keys and values are up-projected from one low-rank latent
  c_KV = RMSNorm(W_DKV h) `[d_c]` per token, and positions act through a decoupled rotary part.

  Per head n (H the head width, d_h^R the rotary width, K key/value heads, G = N / K):
    c_KV = RMSNorm(W_DKV h), k^C = W_UK c_KV, v = W_UV c_KV                   (eqs. 9-11)
    c_Q = RMSNorm(W_DQ h), q^C = W_UQ c_Q, q^R = RoPE(W_QR c_Q)               (eqs. 12-14)
      (with `q_rank` 0 there is no query latent: q^C = W_Q h, q^R = RoPE(W_QR h))
    k^R = RoPE(W_KR h), one rotary key shared by every head                   (eq. 16)
    q = [q^C; q^R], k = [k^C; k^R], softmax(q·k / sqrt(H + d_h^R)) v, then W_O (eqs. 15, 17-19).
  The RMSNorms on c_KV and c_Q are DeepSeek-V2's (its released code, not written in the eqs.).
  With K < N each up-projected key/value head serves G query heads (DeepSeek-V2 has K = N).

  The cache holds c_KV `[d_c]` and k^R `[d_h^R]` per token, nothing per head. The cached step
  absorbs W_UK into the query (q^C·k^C = (W_UK^T q^C)·c_KV) and W_UV into the output
  (sum p v = W_UV sum p c_KV), so it attends over the latents as one shared head of width
  d_c + d_h^R, never expanding the cache.

  Self-attention only (cross-attention is dense). Positions: a method that rotates any width
  (RoPE) rotates the decoupled part; methods that act outside attention (sinusoidal, learned,
  nope) go with d_h^R = 0; score terms and xPos are refused at validation.
  """

  takes_score_terms = False  # the absorbed cached step adds no [T, S] terms
  cached_decoding = 'own'  # `decode` below: the latent cache and the absorbed projections
  has_paged_cache = False
  norms_qk = False  # the latents c_KV, c_Q have their own RMSNorms; model.qk_norm is refused
  layer_terms = ()  # no logit soft cap or sinks in its forward and absorbed steps
  cache_form = 'd_c + d_h^R'
  param_form = ('D·d_c + d_c + 2·d_c·K·H + D·d_h^R + N·H·D + D·N·(H + d_h^R) (or with d_c\': '
                'D·d_c\' + d_c\' + d_c\'·N·(H + d_h^R))')
  options = ('attention_impl', 'unscaled', 'head_dim', 'kernel_init', 'attention_dropout',
             'attention_gate', 'mla_kv_rank', 'mla_q_rank', 'mla_rope_dim')

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, kv_rank, q_rank=0, rope_dim=0,
               head_dim=None, implementation='xla', scale=None, kernel_init=None,
               dropout_rate=0.0, gate='none', rngs):
    """Args:
      d_model, num_heads, num_kv_heads, head_dim: D, N, K (None: N), H (None: D / N).
      kv_rank: d_c, the key/value latent width.
      q_rank: d_c', the query latent width (0: no query latent).
      rope_dim: d_h^R, the decoupled rotary width per head (0: no rotary part), even.
      implementation, scale, kernel_init, dropout_rate, rngs: as `Attention`.
      gate: the output gate (model.attention_gate), as `Attention`'s.
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = d_model // num_heads if head_dim is None else head_dim
    if kv_rank <= 0 or q_rank < 0 or rope_dim < 0 or rope_dim % 2:
      raise ValueError(f'MLA needs kv_rank > 0, q_rank >= 0 and an even rope_dim >= 0; got '
                       f'{kv_rank}, {q_rank}, {rope_dim}')
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.kv_rank, self.q_rank, self.rope_dim = kv_rank, q_rank, rope_dim
    self.implementation = implementation
    self.local_window_size = None
    self.scale = scale
    self.dropout_rate = dropout_rate
    init = nnx.initializers.lecun_normal() if kernel_init is None else kernel_init

    def proj(d_in, d_out, names, **kwargs):  # no biases (DeepSeek-V2); logical axis names
      return nnx.LinearGeneral(d_in, d_out, use_bias=False, rngs=rngs, **kwargs,
                               kernel_init=sharding.partitioned(init, *names))

    def norm(width):
      return nnx.RMSNorm(width, epsilon=RMS_EPS, rngs=rngs,
                         scale_init=sharding.partitioned(nnx.initializers.ones, None))

    n, k, h, r = num_heads, num_kv_heads, head_dim, rope_dim
    self.kv_down = proj(d_model, kv_rank, ('embed', None))  # W_DKV
    self.kv_norm = norm(kv_rank)
    self.key_up = proj(kv_rank, (k, h), (None, 'kv_heads', 'head_dim'))  # W_UK
    self.value_up = proj(kv_rank, (k, h), (None, 'kv_heads', 'head_dim'))  # W_UV
    q_in, q_names = (q_rank, None) if q_rank else (d_model, 'embed')
    if q_rank:
      self.q_down = proj(d_model, q_rank, ('embed', None))  # W_DQ
      self.q_norm = norm(q_rank)
    self.query = proj(q_in, (n, h), (q_names, 'heads', 'head_dim'))  # W_UQ (W_Q without c_Q)
    if r:
      self.query_rope = proj(q_in, (n, r), (q_names, 'heads', 'head_dim'))  # W_QR
      self.key_rope = proj(d_model, r, ('embed', None))  # W_KR
    self.out = proj((n, h), d_model, ('heads', 'head_dim', 'embed'), axis=(-2, -1))  # W_O
    # The output gate as every variant has it; QK-norm is declared off (norms_qk): the latents
    # have their own RMSNorms.
    self.output_gate, self.qk_norm = attention_heads.make(
        gate, 'none', d_model, n, h, use_bias=False, kernel_init=init, rngs=rngs)

  @classmethod
  def from_config(cls, cfg, *, rngs):
    """From `config.model`: sizes, head_dim, mla_kv_rank, mla_q_rank, mla_rope_dim (`rope_dim`),
    attention_impl, unscaled, kernel_init, attention_dropout."""
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, kv_rank=cfg.mla_kv_rank,
               q_rank=cfg.mla_q_rank, rope_dim=rope_dim(cfg), head_dim=initializers.head_dim(cfg),
               implementation=cfg.attention_impl,
               scale=1.0 if cfg.get('unscaled', False) else None,
               kernel_init=initializers.kernel_init(cfg),
               dropout_rate=cfg.get('attention_dropout', 0.0),
               gate=cfg.get('attention_gate', 'none'), rngs=rngs)

  @classmethod
  def param_count(cls, cfg):
    """D·d_c + d_c (W_DKV, its RMSNorm) + 2·d_c·K·H (W_UK, W_UV) + D·d_h^R (W_KR) + N·H·D (W_O)
    + the query side: D·N·(H + d_h^R) (W_Q, W_QR), or with a query latent
    D·d_c' + d_c' + d_c'·N·(H + d_h^R) (W_DQ, its RMSNorm, W_UQ, W_QR)."""
    d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, initializers.head_dim(cfg)
    c, cq, r = cfg.mla_kv_rank, cfg.mla_q_rank, rope_dim(cfg)
    query = (d * cq + cq + cq * n * (h + r)) if cq else d * n * (h + r)
    gate = attention_heads.param_count(cfg, d, n, h, use_bias=False)  # model.attention_gate
    return d * c + c + 2 * c * k * h + d * r + n * h * d + query + gate

  @classmethod
  def cache_per_token(cls, cfg):
    """Elements one layer caches per token: d_c + d_h^R (the latent and the shared rotary key)."""
    return cfg.mla_kv_rank + rope_dim(cfg)

  @classmethod
  def check_options(cls, model_cfg):
    """`model.mla_kv_rank` (> 0), `model.mla_q_rank` (>= 0), `model.mla_rope_dim` (even, >= 0),
    whichever variant is chosen (every config carries them)."""
    m = model_cfg
    for name, low in (('mla_kv_rank', 1), ('mla_q_rank', 0), ('mla_rope_dim', 0)):
      value = m.get(name, low)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = 'a positive integer' if low else 'an integer >= 0'
        raise options.ConfigError(f'model.{name}={value!r} must be {what}')
    if m.get('mla_rope_dim', 0) % 2:
      raise options.ConfigError(f'model.mla_rope_dim={m.mla_rope_dim!r} must be even (RoPE '
                                'rotates pairs); valid: 0 (derived), 2, 4, ...')

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """`model.unscaled`; no projection biases; `model.position` against the rotary part."""
    del data_cfg
    m = model_cfg
    options.boolean('model.unscaled', m.unscaled)
    cls.check_heads(m)
    for name in ('use_bias', 'attention_bias'):
      if m.get(name, False):
        raise options.ConfigError(f'model.{name}={m[name]!r}: model.attention=\'mla\' has no '
                                  'projection biases (DeepSeek-V2); valid value here: False')
    _check_position(m)

  # --- The full forward pass ----------------------------------------------------------------------

  def latent(self, x, positions=None, position=None):
    """What the cache holds: c_KV `[B, T, d_c]` and the rotated k^R `[B, T, d_h^R]`."""
    c_kv = self.kv_norm(self.kv_down(x))  # [B, T, d_c]
    if not self.rope_dim:
      return c_kv, jnp.zeros(x.shape[:2] + (0,), x.dtype)
    k_rope = self.rotate(self.key_rope(x)[:, :, None], positions, position)  # [B, T, 1, R]
    return c_kv, k_rope[:, :, 0]

  def queries(self, x, positions=None, position=None):
    """q^C `[B, T, N, H]` and the rotated q^R `[B, T, N, d_h^R]`."""
    c_q = self.q_norm(self.q_down(x)) if self.q_rank else x  # [B, T, d_c'] or [B, T, D]
    q = sharding.constrain(self.query(c_q), ('batch', 'length', 'heads', 'head_dim'))
    if not self.rope_dim:
      return q, jnp.zeros(q.shape[:3] + (0,), q.dtype)
    return q, self.rotate(self.query_rope(c_q), positions, position)  # [B, T, N, R]

  def rotate(self, x, positions, position):
    """x `[B, T, N, d_h^R]` rotated at `positions` by the position method (validation gives a
    rotary part only with a method that `rotates_any_width`)."""
    if position is None or not position.rotates_any_width:
      raise ValueError(f'MLA has a rotary part of width {self.rope_dim}, which needs a position '
                       "that rotates any width (model.position='rope'); got "
                       f'{type(position).__name__}')
    return position.rotate(x, positions)

  def prepare(self, x, context=None, *, positions=None, context_positions=None, position=None,
              is_causal=False):
    """q = [q^C; q^R] `[B, T, N, H + d_h^R]`, k = [k^C; k^R] `[B, T, K, H + d_h^R]` (k^R shared
    by the heads) and v `[B, T, K, H]` of the unabsorbed form, and no score terms."""
    del context_positions, is_causal
    if context is not None:
      raise ValueError("attention='mla' is self-attention only (cross-attention is dense)")
    if position is not None and (position.rotates and not self.rope_dim):
      raise ValueError('MLA with no rotary part (mla_rope_dim 0) cannot take a rotating position')
    q_c, q_r = self.queries(x, positions, position)  # [B, T, N, H], [B, T, N, R]
    c_kv, k_r = self.latent(x, positions, position)  # [B, T, d_c], [B, T, R]
    k_c = self.key_up(c_kv)  # [B, T, K, H]
    v = sharding.constrain(self.value_up(c_kv), ('batch', 'length', 'kv_heads', 'head_dim'))
    k_r = jnp.broadcast_to(k_r[:, :, None], k_c.shape[:3] + k_r.shape[-1:])  # [B, T, K, R]
    q = jnp.concatenate([q_c, q_r], axis=-1)  # [B, T, N, H + R]
    k = jnp.concatenate([k_c, k_r], axis=-1)  # [B, T, K, H + R]
    return q, k, v, contract.NONE

  def attend(self, q, k, v, terms, *, implementation='xla', **kwargs):
    """`Attention.attend`, with v zero-padded to q's width for a kernel whose row does not
    declare `value_width` (the padded columns of the output are zeros and are cut off)."""
    width, h = q.shape[-1], v.shape[-1]
    if h == width or attention.KERNELS[implementation].value_width:
      return super().attend(q, k, v, terms, implementation=implementation, **kwargs)
    padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, width - h)))  # [B, S, K, H + R]
    return super().attend(q, k, padded, terms, implementation=implementation,
                          **kwargs)[..., :h]  # [B, T, N, H]

  # --- The cached step ---------------------------------------------------------------------------

  def init_cache(self, batch_size, max_length, dtype=jnp.float32):
    """An empty cache of the latents only.

    Returns:
      {'c_kv': `[B, S_max, d_c]`, 'k_rope': `[B, S_max, d_h^R]`} zeros.
    """
    return {'c_kv': jnp.zeros((batch_size, max_length, self.kv_rank), dtype),
            'k_rope': jnp.zeros((batch_size, max_length, self.rope_dim), dtype)}

  def absorbed_query(self, q_c):
    """W_UK absorbed into the query: q^C `[B, T, N, H]` -> `[B, T, N, d_c]`, with
    (W_UK^T q^C)·c_KV = q^C·k^C for each head (its key/value head's W_UK)."""
    b, t, n, h = q_c.shape
    g = n // self.num_kv_heads
    w_uk = self.key_up.kernel[...]  # [d_c, K, H]
    q = q_c.reshape(b, t, self.num_kv_heads, g, h)  # [B, T, K, G, H]
    return jnp.einsum('BTKGH,CKH->BTKGC', q, w_uk.astype(q.dtype)).reshape(b, t, n, -1)

  def absorbed_output(self, o_lat):
    """W_UV absorbed into the output: `[B, T, N, d_c]` (the probabilities times c_KV) ->
    `[B, T, N, H]`, equal to the probabilities times v."""
    b, t, n, c = o_lat.shape
    w_uv = self.value_up.kernel[...]  # [d_c, K, H]
    o = o_lat.reshape(b, t, self.num_kv_heads, n // self.num_kv_heads, c)  # [B, T, K, G, d_c]
    return jnp.einsum('BTKGC,CKH->BTKGH', o, w_uv.astype(o.dtype)).reshape(b, t, n, -1)

  def decode(self, x, cache, index, *, position=None):
    """Causal self-attention of one new token per row against the latent cache, which it extends:
    the attention runs over c_KV and k^R as one key/value head (the absorbed form).

    Args:
      x: `[B, 1, D]` the new tokens' input.
      cache: {'c_kv': `[B, S_max, d_c]`, 'k_rope': `[B, S_max, d_h^R]`}; slots `< index` hold
        the row's earlier tokens.
      index: `[B]` int (or a scalar), each row's absolute position; its latent goes in that slot.
      position: the `layers.positions` object (it rotates q^R and k^R at `index`).

    Returns:
      (`[B, 1, D]`, the updated cache).
    """
    b, s_max = x.shape[0], cache['c_kv'].shape[1]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))  # [B]
    q_pos = index[:, None]  # [B, 1]
    c_new, kr_new = self.latent(x, q_pos, position)  # [B, 1, d_c], [B, 1, R]
    rows = jnp.arange(b)
    cache = {'c_kv': cache['c_kv'].at[rows, index].set(c_new[:, 0].astype(cache['c_kv'].dtype)),
             'k_rope': cache['k_rope'].at[rows, index].set(
                 kr_new[:, 0].astype(cache['k_rope'].dtype))}
    q_c, q_r = self.queries(x, q_pos, position)  # [B, 1, N, H], [B, 1, N, R]
    q = jnp.concatenate([self.absorbed_query(q_c), q_r], axis=-1)  # [B, 1, N, d_c + R]
    keys = jnp.concatenate([cache['c_kv'], cache['k_rope']], axis=-1)[:, :, None]  # [B, S, 1, .]
    values = cache['c_kv'][:, :, None]  # [B, S_max, 1, d_c]
    k_pos = jnp.arange(s_max, dtype=jnp.int32)[None]  # [1, S_max]
    # Slots after the row's position are empty (or stale): causality on absolute positions.
    vis = masks.visible(q_pos[:, :, None], k_pos[:, None, :], is_causal=True, window=None)
    # The scale of the unabsorbed scores, 1/sqrt(H + d_h^R), not of this query's width.
    scale = self.score_scale(self.head_dim + self.rope_dim)
    kernel = attention.KERNELS[self.implementation]
    impl = self.implementation if kernel.decodes and kernel.value_width else 'xla'
    o_lat = attention.dot_product_attention(
        q, keys.astype(q.dtype), values.astype(q.dtype), mask=vis[:, None], scale=scale,
        implementation=impl)  # [B, 1, N, d_c]
    return self.output(self.absorbed_output(o_lat), x), cache  # [B, 1, D]



def _check_position(model_cfg):
  """`model.position` against MLA: a method that rotates any width (RoPE) for the rotary part,
  or one acting outside attention (sinusoidal, learned, nope) with no rotary part; score terms
  (the absorbed step has no [T, S] scores to add them to) and xPos (a head-width rotation) are
  refused. Read from the methods' declarations (`rotates`, `rotates_any_width`, `terms_for`)."""
  m = model_cfg
  position = positions_lib.POSITIONS[m.position]
  turning = sorted(p for p, v in positions_lib.POSITIONS.items() if v.rotates_any_width)
  plain = sorted(p for p, v in positions_lib.POSITIONS.items()
                 if not v.rotates and not v.terms_for(m))
  why = None
  if position.terms_for(m):
    why = 'adds a term to the scores, which the absorbed cached step does not add'
  elif position.rotates and not position.rotates_any_width:
    why = 'rotates q and k at their head width only, not the decoupled rotary key'
  if why:
    raise options.ConfigError(f'model.position={m.position!r} {why}: model.attention=\'mla\' '
                              f'cannot take it; valid values: {", ".join(sorted(turning + plain))}')
  if position.rotates_any_width and m.get('rope_fraction', 1.0) != 1.0:
    # A RoPE option for the heads' own rotation; MLA's rotary part is rotated whole.
    raise options.ConfigError(
        f'model.rope_fraction={m.rope_fraction!r} is not read by model.attention=\'mla\', '
        'whose decoupled rotary part (model.mla_rope_dim) is rotated whole; valid value here: 1.0')
  if m.get('mla_rope_dim', 0) and not position.rotates_any_width:
    raise options.ConfigError(
        f'model.mla_rope_dim={m.mla_rope_dim!r} is a rotary part, which model.position='
        f'{m.position!r} does not rotate; valid: model.mla_rope_dim=0, or model.position in: '
        f'{", ".join(turning)}')
