"""The tiling and online-softmax pieces of every flash kernel (blockwise, ring, Pallas GPU/TPU).

Each kernel cuts q, k, v into tiles in its own layout and calls these pure jnp functions on them:
`TileConfig` and the visible-block bands (`key_block_band`, `query_block_band`) of the tiled
kernels, `tile_logits` (scale, biases, soft cap, visibility), `online_update` (the running
max/sum/output after one key tile), `finalize` (output and logsumexp, the sinks folded in),
`tile_grads` (the backward pass on one tile: P, dV, dP, dS, dK, dQ), `sink_grad`, and `flash_vjp`
(the custom VJP with O(T) residuals). They run inside Pallas kernel bodies too, so they use only
ops that both Triton and Mosaic lower: `jnp.where` masks, elementwise math, reductions over the
last axis, last-two-axes transposes of float32 tiles, and `lax.dot_general` with float32
accumulation.

Row statistics (running max, sum, logsumexp, the backward's delta) are `[..., bq]`, one per query
row, or lane-replicated `[..., bq, 128]` (the Mosaic kernel keeps them one vreg row wide); the
functions below accept either layout and broadcast them against a `[..., bq, W]` tile accordingly.
A tile's q and dO are `[..., bq, H]` and its k and v `[..., bk, H]`, k's leading axes a prefix of
q's (the blockwise and ring kernels' G query heads of a key/value head; none in the Pallas
kernels' 2-D tiles).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from layers import masks


class TileConfig(NamedTuple):
  """Static (hashable) settings of one tiled kernel call (blockwise, and both Pallas kernels)."""
  scale: float
  is_causal: bool
  window: tuple | None
  q_len: int  # T before padding
  kv_len: int  # S before padding
  block_q: int
  block_k: int
  dropout_rate: float = 0.0  # attention dropout on the probabilities (0 = none)
  bias_fn: object = None  # PositionBias.fn (FIRE, KERPLE) evaluated per tile, or None
  softcap: float = 0.0  # c > 0: logits c·tanh(logits / c) (`tile_logits`); 0 = none


def _floor_div(x, d):
  """x // d for x >= 0, as `lax.div` (also lowers where `//` on a program id does not, e.g.
  Triton)."""
  return lax.div(x, jnp.asarray(d, x.dtype))


def _reach(cfg):
  """(left, right): how far before and after a query its visible keys may lie, None if unbounded.

  Causality is a window whose right reach is at most 0, so both bands follow from one rule.
  """
  left, right = (None, None) if cfg.window is None else cfg.window
  if cfg.is_causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def _band(idx, size, other, count, before, after):
  """[lo, hi) of the blocks of `other` positions (`count` of them) holding a position within
  [p - before, p + after] of some position p of block `idx` of `size` positions (None: unbounded).
  """
  first = jnp.asarray(idx, jnp.int32) * size
  last = first + (size - 1)
  lo, hi = jnp.int32(0), jnp.int32(count)
  if before is not None:
    lo = _floor_div(jnp.maximum(first - before, 0), other)
  if after is not None:
    # ceil((last + after + 1) / other): one past the block of the last position in reach (0 if
    # none).
    hi = jnp.minimum(hi, _floor_div(jnp.maximum(last + after + other, 0), other))
  return lo, hi


def key_block_band(i, cfg, num_k_blocks):
  """[lo, hi) of the key blocks that may hold a key visible from query block i (i: int32 scalar).

  Blocks outside the band are hidden by causality or the window, so they are never computed.
  """
  left, right = _reach(cfg)
  return _band(i, cfg.block_q, cfg.block_k, num_k_blocks, left, right)


def query_block_band(j, cfg, num_q_blocks):
  """[lo, hi) of the query blocks that may see a key of key block j (the transpose of the band)."""
  left, right = _reach(cfg)
  return _band(j, cfg.block_k, cfg.block_q, num_q_blocks, right, left)


def visited_tiles(cfg, num_q_blocks, num_k_blocks):
  """How many (query tile, key tile) pairs a kernel that skips the tiles outside each band computes:
  the sum of every query tile's key band (`key_block_band`), counted on the host (a Python int,
  for cost estimates and FLOP counts)."""
  left, right = _reach(cfg)
  total = 0
  for i in range(num_q_blocks):
    first, last = i * cfg.block_q, i * cfg.block_q + cfg.block_q - 1
    lo = 0 if left is None else max(first - left, 0) // cfg.block_k
    hi = num_k_blocks if right is None else min(num_k_blocks,
                                                max(last + right + cfg.block_k, 0) // cfg.block_k)
    total += max(hi - lo, 0)
  return total


def pad_axis(x, axis, size, value=0):
  """`x` padded with `value` at the end of `axis` to length `size` (unchanged if already so)."""
  pad = size - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def softcap_logits(s, softcap):
  """c·tanh(s / c) for a cap c > 0 (Gemma 2): every logit in (-c, c); `s` unchanged for c falsy."""
  return softcap * jnp.tanh(s / softcap) if softcap else s


def tile_logits(qk, q_pos, k_pos, *, scale, is_causal=False, window=None, kv_len=None, bias=None,
                slope=None, position_bias=None, q_seg=None, k_seg=None, mask=None, softcap=None):
  """Scaled, biased scores of one tile, -inf where the key is hidden from the query.

  Args:
    qk: the tile's q·kᵀ `[..., bq, bk]` float32 (each kernel multiplies in its own layout).
    q_pos, k_pos: int positions broadcastable against the tile's last two axes (`[bq, 1]` and
      `[1, bk]`, or whole `[bq, bk]` tiles where 1-D iotas do not lower, as in Mosaic).
    scale: the score scale (1/sqrt(H) by default), applied before any bias.
    is_causal, window: see `masks.visible`.
    kv_len: None, or the key length S: keys at or past it pad the last tile and are hidden.
    bias: None or a float32 dense bias tile broadcastable to `qk`.
    slope: None or float32 ALiBi slopes broadcastable to `qk` (`[K, G, 1, 1]`, `[1]`, a scalar):
      adds `masks.alibi_bias`'s -slope * |i - j| from the tile's positions.
    position_bias: None or a learned position bias (FIRE, KERPLE, T5) evaluated on the tile's
      positions, broadcastable to `qk`.
    q_seg, k_seg: None or segment ids broadcastable like q_pos / k_pos (leading batch axes allowed).
    mask: None or a boolean tile broadcastable to `qk`, True where visible.
    softcap: None/0 or the cap c > 0, applied to the scaled scores plus the added terms.

  Returns:
    `[..., bq, bk]` float32 (the broadcast shape).
  """
  s = qk * scale
  if bias is not None:
    s = s + bias
  if slope is not None:
    # From the tile's positions: the [N, T, S] bias is never formed.
    s = s - slope * jnp.abs(q_pos - k_pos).astype(jnp.float32)
  if position_bias is not None:
    s = s + position_bias
  s = softcap_logits(s, softcap)
  vis = masks.visible(q_pos, k_pos, is_causal=is_causal, window=window, q_seg=q_seg, k_seg=k_seg)
  if kv_len is not None:
    in_range = k_pos < kv_len
    vis = in_range if vis is None else vis & in_range
  if mask is not None:
    vis = mask if vis is None else vis & mask
  if vis is None:
    return s
  # -inf (not a large finite value): exp gives exact zeros, and the running max of a row that has
  # seen no visible key stays -inf, which `safe_max` turns into a finite shift.
  return jnp.where(vis, s, -jnp.inf)


def safe_max(m):
  """A row max usable as an exp shift: -inf (no visible key yet) becomes 0, so exp(-inf - 0) = 0."""
  return jnp.where(m == -jnp.inf, 0.0, m)


def _as_stat(x, like):
  """A row reduction `[..., bq]` in the layout of the statistic `like` (lane-replicated or not)."""
  return x if x.ndim == like.ndim else x[..., None]


def _across(stat, tile):
  """A row statistic broadcast against `tile` `[..., bq, W]`: a trailing axis for `[..., bq]`;
  a lane-replicated `[..., bq, 128]` is sliced (W < 128) or tiled (W a multiple of 128) to W."""
  if stat.ndim < tile.ndim:
    return stat[..., None]
  lanes, width = stat.shape[-1], tile.shape[-1]
  if width == lanes:
    return stat
  if width < lanes:
    return stat[..., :width]
  return jnp.tile(stat, (1,) * (stat.ndim - 1) + (width // lanes,))


def tile_dot(x, y, dims):
  """`lax.dot_general` of two tiles with float32 accumulation. Below float32 the precision is
  pinned to DEFAULT: under `jax.default_matmul_precision('highest')` a bfloat16 product would
  otherwise ask Mosaic for an fp32-contract matmul, which it refuses ("Bad lhs type"); a product
  of two bfloat16 values is exact in float32 either way."""
  precision = None if x.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(x, y, dims, precision=precision, preferred_element_type=jnp.float32)


def _times_v(p, v):
  """p `[..., bq, bk]` @ v `[..., bk, H]` in float32; v's leading axes are p's leading batch axes
  (p may have more, e.g. the G query heads of a key/value head): `[..., bq, H]`."""
  batch = tuple(range(v.ndim - 2))
  dims = (((p.ndim - 1,), (v.ndim - 2,)), (batch, batch))
  return tile_dot(p.astype(v.dtype), v, dims)


def init_carry(rows, width):
  """The online softmax before any key: max -inf, sum 0, output 0 (`rows`, `rows` + (width,))."""
  return (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
          jnp.zeros(tuple(rows) + (width,), jnp.float32))


def online_update(carry, logits, v, *, dropout=None):
  """Folds one key tile into the online softmax (FlashAttention-2).

  Args:
    carry: (m, l, acc): running max and sum `[..., bq]` (or lane-replicated `[..., bq, 128]`) and
      the un-normalised output `[..., bq, H]`, all float32.
    logits: `[..., bq, bk]` float32 from `tile_logits`.
    v: `[..., bk, H]`, its leading axes a prefix of the logits' batch axes.
    dropout: None, or a function of the probabilities giving those multiplied with v (attention
      dropout acts after the softmax: the sum keeps the undropped ones).

  Returns:
    The carry after the tile.
  """
  m, l, acc = carry
  m_new = jnp.maximum(m, _as_stat(jnp.max(logits, axis=-1), m))
  shift = safe_max(m_new)
  p = jnp.exp(logits - _across(shift, logits))  # [..., bq, bk]
  # The max grew: earlier tiles' sums were taken against a smaller shift, rescale them.
  alpha = jnp.exp(m - shift)
  l = alpha * l + _as_stat(jnp.sum(p, axis=-1), l)
  pv = _times_v(p if dropout is None else dropout(p), v)  # [..., bq, H]
  return m_new, l, _across(alpha, acc) * acc + pv


def finalize(carry, sink=None):
  """(out `[..., bq, H]`, lse) of the online softmax; rows that saw no key give zeros and lse +inf.

  +inf makes every probability the backward pass recomputes, exp(s - lse), exactly 0 on such rows.
  A `sink` logit (broadcastable to the row statistics) joins the sum only, as one more key with no
  value: it is folded in here rather than at the start, so the tile loop is the same with or
  without it; lse then includes it, and a row that saw no key gives zeros and lse = sink.
  """
  m, l, acc = carry
  if sink is not None:
    m_new = jnp.maximum(m, sink)  # finite: the sink is
    alpha = jnp.exp(m - m_new)  # 0 where no key was seen (m = -inf)
    m, l, acc = m_new, alpha * l + jnp.exp(sink - m_new), _across(alpha, acc) * acc
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  return acc / _across(l_safe, acc), jnp.where(empty, jnp.inf, m + jnp.log(l_safe))


def probabilities(logits, lse):
  """The forward's softmax of a tile, recomputed from its logits and the rows' logsumexp."""
  return jnp.exp(logits - _across(lse, logits))


def backward_delta(out, d_out):
  """rowsum(dO * O) `[..., bq]` = sum_j P_ij dP_ij per row (also with dropout, O being the dropped
  output and dP the gradient reaching the undropped P, as in FlashAttention)."""
  return jnp.sum(out * d_out.astype(jnp.float32), axis=-1)


def ds(p, dp, delta, logits=None, softcap=None):
  """d loss / d logits of a tile: P * (dP - delta), delta from `backward_delta` (the softmax's
  Jacobian applied to dP without forming it). With a `softcap` c, d loss / d the logits before the
  cap: times 1 - tanh² = 1 - (s / c)² of the capped `logits` s (clipped: -inf where hidden, and P
  is 0 there)."""
  d = p * (dp - _across(delta, p))
  if softcap:
    d = d * (1.0 - jnp.square(jnp.clip(logits / softcap, -1.0, 1.0)))
  return d


class TileGrads(NamedTuple):
  """One tile's gradients, None where not asked for: dS `[..., bq, bk]` (d loss / d the logits
  before the cap), dQ `[..., bq, H]`, dK and dV `[..., bk, H]` (k's axes), all float32."""
  ds: jax.Array
  dq: jax.Array | None
  dk: jax.Array | None
  dv: jax.Array | None


def _times_t(x, y):
  """x @ yᵀ in float32: x `[..., bq, H]`, y `[..., bk, H]` (its leading axes a prefix of x's):
  `[..., bq, bk]`. One NT `dot_general`, which both Triton and Mosaic lower without a transpose."""
  batch = tuple(range(y.ndim - 2))
  dims = (((x.ndim - 1,), (y.ndim - 1,)), (batch, batch))
  return tile_dot(x, y, dims)


def _t_times(x, y, batch):
  """xᵀ @ y in float32, summed over every axis but the first `batch` (k's leading axes) and x's
  last: x `[..., bq, bk]`, y `[..., bq, H]` -> `[*x.shape[:batch], bk, H]` (the rows, and the G
  query heads of a key/value head, are summed). The transpose comes first, in float32, then the
  cast to y's dtype: 32-bit transposes lower on every TPU generation (jax's TPU flash kernel's
  order)."""
  xt = jnp.swapaxes(x, -1, -2).astype(y.dtype)  # [..., bk, bq]
  rows = tuple(range(batch, x.ndim - 2))
  keep = tuple(range(batch))
  dims = ((rows + (x.ndim - 1,), rows + (y.ndim - 2,)), (keep, keep))
  return tile_dot(xt, y, dims)


def tile_grads(logits, lse, delta, q, k, v, do, *, softcap=None, scale=None, dropout=None,
               dq=True, dkv=True):
  """The backward pass on one tile (FlashAttention-2), written once for every kernel.

  P is recomputed from the logits and the rows' logsumexp; then dV = Pᵀ dO, dP = dO Vᵀ,
  dS = `ds(P, dP, delta)`, dK = dSᵀ Q · scale, dQ = dS K · scale.

  Args:
    logits: the tile's `[..., bq, bk]` float32 logits from `tile_logits`, as in the forward.
    lse, delta: the rows' logsumexp (+inf on empty rows: P = 0 there) and `backward_delta`,
      `[..., bq]` or lane-replicated `[..., bq, 128]`.
    q, do: `[..., bq, H]`; k, v: `[..., bk, H]`, their leading axes a prefix of q's.
    softcap: as in `ds`.
    scale: None, or the score scale multiplied into this tile's dK and dQ (a kernel that
      accumulates them over tiles may scale the sum once instead, and passes None).
    dropout: None, or the function that drops P for dV and dP (attention dropout, as forward).
    dq, dkv: which products to form (the Pallas kernels compute dQ and dK/dV in two passes).

  Returns:
    `TileGrads`.
  """
  drop = (lambda x: x) if dropout is None else dropout
  scaled = (lambda x: x) if scale is None else (lambda x: scale * x)
  p = probabilities(logits, lse)  # [..., bq, bk]
  # The softmax's Jacobian takes the undropped P; dP is the gradient reaching it through dropout.
  d = ds(p, drop(_times_t(do, v)), delta, logits, softcap)  # [..., bq, bk]
  d_q = scaled(_times_v(d, k)) if dq else None  # [..., bq, H]
  d_k = scaled(_t_times(d, q, k.ndim - 2)) if dkv else None  # [..., bk, H]
  d_v = _t_times(drop(p), do, k.ndim - 2) if dkv else None  # [..., bk, H]
  return TileGrads(d, d_q, d_k, d_v)


def sink_grad(sinks, lse, delta, axes):
  """d loss / d sink logits: -sum over rows of p_sink · delta, p_sink = exp(sink - lse) (the
  sink's probability; each output row is scaled by 1 - p_sink when the sink grows), summed over
  `axes` of the `lse`/`delta` rows (the batch and query axes). `sinks` broadcasts against them."""
  return -jnp.sum(jnp.exp(sinks - lse) * delta, axis=axes)


def flash_vjp(forward, backward):
  """A flash kernel with a custom VJP whose residuals are O(T): the inputs, output and logsumexp.

  Autodiff through the kernel's loops would store every tile's probabilities instead, and make
  memory quadratic again; the backward pass recomputes them tile by tile.

  Args:
    forward: `forward(static, *args) -> (out, lse)`.
    backward: `backward(static, args, out, lse, d_out) -> cotangents of args` (None for arrays
      that receive none, e.g. segment ids).

  Returns:
    `f(static, *args) -> out`; `static` (hashable settings) is not differentiated.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def flash(static, *args):
    return forward(static, *args)[0]

  def flash_fwd(static, *args):
    out, lse = forward(static, *args)
    return out, (args, out, lse)

  def flash_bwd(static, res, d_out):
    args, out, lse = res
    return tuple(backward(static, args, out, lse, d_out))

  flash.defvjp(flash_fwd, flash_bwd)
  return flash
