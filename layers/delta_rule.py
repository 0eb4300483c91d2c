"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024): chunked, recurrent and implied forms."""

import jax
import jax.numpy as jnp

# Per state head, with the state S stored as `[H, J]` (key width H, value width J; the paper's S_t
# is its transpose), a decay α_t = exp(g_t) in (0, 1] and a write strength β_t in (0, 1):
#     S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t
# (the paper's `[J, H]` layout: S_t = S_{t-1} α_t (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t).
# The decay forgets; the delta rule replaces the value stored under k_t by v_t, to the extent β_t.
# `recurrent_step` is one token (decoding); `chunked` the training form (flash-linear-attention's
# chunk_gated_delta_rule, fla/ops/gated_delta_rule/naive.py, in JAX); `implied_weights` the
# `[T, T]` matrix W with o = W v. Einsum letters beyond the legend: C chunks, c, i, j positions in
# a chunk, J the value width.

# Added to |x|² under the square root of the L2 norm (fla's l2norm_fwd): a zero vector stays zero.
L2_EPS = 1e-6


def l2_normalise(x, eps=L2_EPS):
  """x / sqrt(|x|² + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), -1, keepdims=True) + eps)


def decay_log(a, a_log, dt_bias):
  """g = -exp(A_log) · softplus(a + dt_bias) <= 0, Mamba2's discretised decay: α = exp(g).

  Args:
    a: `[B, T, K]` the input's decay logits (W_a x).
    a_log, dt_bias: `[K]` per state head.

  Returns:
    `[B, T, K]` float32.
  """
  a = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
  return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a)


def short_conv(x, w, state=None, segment_ids=None):
  """Causal depthwise convolution then SiLU: out_t = silu(sum_i w_i x_{t-W+1+i}).

  Args:
    x: `[B, T, ...]` inputs (channels after the length).
    w: `[W, ...]` one kernel of width W per channel.
    state: `[B, W-1, ...]` the W-1 inputs before x (None: zeros, the start of a sequence).
    segment_ids: `[B, T]` or None; an input reaches only outputs of its own segment (the
      inputs before x, `state`, belong to none: give no state with segments).

  Returns:
    (`[B, T, ...]`, the new state `[B, W-1, ...]`: the last W-1 inputs).
  """
  width, t = w.shape[0], x.shape[1]
  if state is None:
    state = jnp.zeros((x.shape[0], width - 1) + x.shape[2:], x.dtype)
  xs = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, W-1+T, ...]
  if segment_ids is not None:
    seg = jnp.pad(segment_ids, [(0, 0), (width - 1, 0)], constant_values=-1)  # [B, W-1+T]
    channels = (1,) * (x.ndim - 2)

    def tap(i):  # tap i of every output, zero where it would cross into another segment
      same = (seg[:, i:i + t] == segment_ids).reshape(segment_ids.shape + channels)
      return jnp.where(same, xs[:, i:i + t], 0)
  else:
    tap = lambda i: xs[:, i:i + t]
  out = sum(w[i].astype(x.dtype) * tap(i) for i in range(width))
  return jax.nn.silu(out), xs[:, t:]


def recurrent_step(state, q, k, v, beta, g):
  """One token of the gated delta rule per state head.

  Args:
    state: `[B, K, H, J]` float32.
    q: `[B, K, G, H]` the G queries that read this state (normalised and scaled).
    k: `[B, K, H]` the key (L2-normalised); v: `[B, K, J]`.
    beta: `[B, K]` in (0, 1); g: `[B, K]` the log-decay (<= 0).

  Returns:
    (`[B, K, G, J]` float32 outputs, the new state).
  """
  q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  state = state * jnp.exp(g)[..., None, None]
  # The value the state now holds under k is replaced by v, to the extent beta.
  delta = beta[..., None] * (v - jnp.einsum('BKHJ,BKH->BKJ', state, k))  # [B, K, J]
  state = state + jnp.einsum('BKH,BKJ->BKHJ', k, delta)
  return jnp.einsum('BKGH,BKHJ->BKGJ', q, state), state


def _intra(k, beta, g, same=None):
  """The within-chunk quantities of `[..., c, ...]` inputs (any leading axes).

  `same` `[..., c, c]` (None: all True) is True where positions i and j lie in one segment: the
  decay between segments is 0, as if g were -inf at each segment's start.

  Returns:
    (gam `[..., c]` the inclusive cumulative log-decay, decay `[..., c, c]` exp(gam_i - gam_j)
    on i >= j within a segment and 0 elsewhere, m `[..., c, c]` =
    I + strict_tril(diag(β) K Kᵀ ⊙ decay)).
  """
  c = g.shape[-1]
  gam = jnp.cumsum(g, -1)  # [..., c]
  lower = jnp.tril(jnp.ones((c, c), bool))
  if same is not None:
    lower = lower & same
  diff = gam[..., :, None] - gam[..., None, :]  # [..., c, c]
  # exp of the masked difference only: above the diagonal it is positive and may overflow.
  decay = jnp.where(lower, jnp.exp(jnp.where(lower, diff, 0.0)), 0.0)
  kk = jnp.einsum('...iH,...jH->...ij', k, k)  # [..., c, c]
  strict = jnp.tril(jnp.ones((c, c), jnp.float32), -1)
  m = jnp.eye(c, dtype=jnp.float32) + strict * beta[..., :, None] * kk * decay
  return gam, decay, m


def unit_lower_inverse(m):
  """m⁻¹ of the unit lower-triangular m `[..., c, c]` by blockwise inversion in matmuls only,
  [[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹ C A⁻¹, D⁻¹]], doubling the block size from 1 (every
  block of a level in one batched matmul): log2(c) levels, c padded to a power of two with I.

  Not `solve_triangular`: on the CPU it is a LAPACK custom call that spreads a batch over XLA's
  intra-op thread pool and waits on it; two of them in flight at once wait on each other, and
  training stops (seen with jaxlib 0.10.2 on a 2-core host, after 1 to 29 steps).
  """
  c = m.shape[-1]
  size = 1 << max(c - 1, 0).bit_length()  # the power of two >= c
  lead = m.shape[:-2]
  if size != c:
    pad = [(0, 0)] * len(lead) + [(0, size - c), (0, size - c)]
    m = jnp.pad(m, pad) + jnp.diag((jnp.arange(size) >= c).astype(m.dtype))  # I on the pad
  inv = jnp.ones(lead + (size, 1, 1), m.dtype)  # [..., size / s, s, s]: the diagonal blocks'
  s = 1
  while s < size:
    n = size // (2 * s)  # blocks of 2s
    blocks = m.reshape(lead + (n, 2 * s, n, 2 * s))
    diag = jnp.diagonal(blocks, axis1=-4, axis2=-2)  # [..., 2s, 2s, n]
    cross = jnp.moveaxis(diag, -1, -3)[..., s:, :s]  # [..., n, s, s]: C of each block
    a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]  # [..., n, s, s] each
    lower = -jnp.matmul(d_inv, jnp.matmul(cross, a_inv))  # [..., n, s, s]
    top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], -1)  # [..., n, s, 2s]
    inv = jnp.concatenate([top, jnp.concatenate([lower, d_inv], -1)], -2)  # [..., n, 2s, 2s]
    s *= 2
  return inv[..., 0, :c, :c]


def _solve(m, rhs):
  """m⁻¹ rhs for the unit lower-triangular m `[..., c, c]` (`unit_lower_inverse`)."""
  return jnp.matmul(unit_lower_inverse(m), rhs)


def _chunk_terms(q, k, v, beta, g, seg, seg_prev):
  """Everything of each chunk but the state it starts from (inputs `[B, K, C, c, ...]`, `seg`
  `[B, 1, C, c]` segment ids, `seg_prev` `[B, 1, C, 1]` the id of the token before each chunk,
  whose segment the incoming state belongs to). A token of another segment sees none of it."""
  same = seg[..., :, None] == seg[..., None, :]  # [B, 1, C, c, c]
  carried = (seg == seg_prev).astype(jnp.float32)  # [B, 1, C, c]: the incoming state reaches it
  gam, decay, m = _intra(k, beta, g, same)  # [B, K, C, c], [B, K, C, c, c] x 2
  u = _solve(m, beta[..., None] * v)  # [B, K, C, c, J]
  w = _solve(m, (beta * jnp.exp(gam) * carried)[..., None] * k)  # [B, K, C, c, H]
  qk = jnp.einsum('BKCiGH,BKCjH->BKCGij', q, k) * decay[:, :, :, None]  # [B, K, C, G, c, c]
  # q decayed since the chunk began, k until it ends (0 across a segment start).
  q_dec = q * (jnp.exp(gam) * carried)[..., None, None]  # [B, K, C, c, G, H]
  last = gam[..., -1:]  # [B, K, C, 1]
  k_dec = k * (jnp.exp(last - gam) * same[..., -1, :])[..., None]  # [B, K, C, c, H]
  keep = jnp.exp(last) * carried[..., -1:]  # [B, K, C, 1]: what of the state passes the chunk
  return u, w, qk, q_dec, k_dec, keep


def chunked(q, k, v, beta, g, *, chunk, state=None, segment_ids=None):
  """The gated delta rule over a whole sequence, chunk by chunk (the WY / UT representation).

  Inside a chunk of c tokens the c rank-one updates are folded into one: with
  T = (I + strict_tril(diag(β) K Kᵀ ⊙ Γ))⁻¹ (Γ_ij = exp(gam_i - gam_j)), U = T diag(β) V and
  W = T diag(β exp(gam)) K (T by `unit_lower_inverse`), the chunk's writes are U - W S, its outputs
  (Q ⊙ exp(gam)) S + tril(Q Kᵀ ⊙ Γ)(U - W S), and the state after it
  exp(gam_c) S + (K ⊙ exp(gam_c - gam))ᵀ (U - W S). Everything but S is computed for all chunks
  at once; `lax.scan` carries S across chunks. A length that c does not divide is padded with
  tokens that neither decay (g = 0) nor write (β = 0); their outputs are dropped. At a segment
  start the state restarts from zero (the decay across it is 0).

  Args:
    q: `[B, T, K, G, H]` queries (normalised and scaled), G per state head.
    k: `[B, T, K, H]` keys (L2-normalised); v: `[B, T, K, J]`.
    beta: `[B, T, K]`; g: `[B, T, K]` log-decays (<= 0).
    chunk: c, the chunk length (min(c, T) is used).
    state: `[B, K, H, J]` the state before the sequence (None: zeros), of the first segment.
    segment_ids: `[B, T]` or None (one segment); contiguous runs of one id are sequences.

  Returns:
    (`[B, T, K, G, J]` float32, the final state `[B, K, H, J]`).
  """
  b, t, kh, gq, h = q.shape
  j = v.shape[-1]
  c = min(chunk, t)
  nc = -(-t // c)
  pad = nc * c - t

  def chunks(x, mode='constant'):  # [B, T, K, ...] -> [B, K, C, c, ...], padded
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode=mode)
    return jnp.moveaxis(x.reshape((b, nc, c) + x.shape[2:]), 3, 1)

  q, k, v, beta, g = (chunks(a.astype(jnp.float32)) for a in (q, k, v, beta, g))
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids
  seg = chunks(seg[:, :, None], mode='edge')  # [B, 1, C, c]: padding joins the last segment
  # The id before each chunk; the initial state belongs to the first token's segment.
  seg_prev = jnp.concatenate([seg[:, :, :1, :1], seg[:, :, :-1, -1:]], axis=2)  # [B, 1, C, 1]

  def step(s, xs):  # s: [B, K, H, J]
    u_c, w_c, qk_c, q_c, k_c, keep_c = xs
    new = u_c - jnp.einsum('BKcH,BKHJ->BKcJ', w_c, s)  # [B, K, c, J]: the chunk's writes
    out = (jnp.einsum('BKcGH,BKHJ->BKcGJ', q_c, s)
           + jnp.einsum('BKGij,BKjJ->BKiGJ', qk_c, new))  # [B, K, c, G, J]
    s = keep_c[..., None] * s + jnp.einsum('BKcH,BKcJ->BKHJ', k_c, new)
    return s, out

  s0 = jnp.zeros((b, kh, h, j), jnp.float32) if state is None else state.astype(jnp.float32)
  terms = _chunk_terms(q, k, v, beta, g, seg, seg_prev)
  s, out = jax.lax.scan(step, s0, tuple(jnp.moveaxis(a, 2, 0) for a in terms))  # chunks first
  out = jnp.moveaxis(out, 0, 2).reshape(b, kh, nc * c, gq, j)[:, :, :t]  # [B, K, T, G, J]
  return jnp.moveaxis(out, 1, 2), s  # [B, T, K, G, J]


def recurrent(q, k, v, beta, g, *, state=None):
  """`chunked`'s result token by token through `recurrent_step` (the decoding form)."""
  b, t, kh, gq, h = q.shape
  s0 = (jnp.zeros((b, kh, h, v.shape[-1]), jnp.float32) if state is None
        else state.astype(jnp.float32))
  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, beta, g))  # time first

  def step(s, x):
    out, s = recurrent_step(s, *x)
    return s, out

  s, out = jax.lax.scan(step, s0, xs)  # [T, B, K, G, J]
  return jnp.moveaxis(out, 0, 1), s


def implied_weights(q, k, beta, g, segment_ids=None):
  """The `[B, K, G, T, T]` matrix W with `chunked`'s output o_i = sum_j W_ij v_j (from a zero
  state): one chunk of length T, W = tril(Q Kᵀ ⊙ Γ) T diag(β), 0 across segments.
  Lower-triangular, and signed: the delta rule subtracts what earlier keys stored. Quadratic in T:
  for plots and tests."""
  q, k, beta, g = (jnp.moveaxis(a.astype(jnp.float32), 1, 2) for a in (q, k, beta, g))
  same = None
  if segment_ids is not None:
    same = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, T]
  _, decay, m = _intra(k, beta, g, same)  # q: [B, K, T, G, H]; decay, m: [B, K, T, T]
  qk = jnp.einsum('BKiGH,BKjH->BKGij', q, k) * decay[:, :, None]  # [B, K, G, T, T]
  t_beta = _solve(m, jnp.eye(m.shape[-1], dtype=jnp.float32)) * beta[..., None, :]  # T diag(β)
  return jnp.einsum('BKGij,BKjl->BKGil', qk, t_beta)
