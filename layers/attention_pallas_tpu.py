"""FlashAttention-2 as Mosaic TPU Pallas kernels (forward, dQ, dK/dV) with a custom VJP.

Written the way Mosaic wants it (jax's pallas/ops/tpu/flash_attention.py is the model):
every block's
last two dimensions are multiples of (8, 128) or the whole array dimension; the loop over the other
sequence is the last grid dimension, marked "arbitrary", so that the running max, sum and output
accumulate in VMEM scratch across its steps; per-row statistics are kept 128 lanes wide (one vreg
row) and tiled to the key tile's width. Tiles outside the causal/window band of
`layers.attention_blockwise` are skipped: their step does no work (`pl.when`) and their index map
repeats the band's edge block, so the pipeline fetches nothing new for them.

The tile logits, the online update and finalize (on statistics in that lane layout), dS and the
custom VJP are `layers.flash_core`'s, shared with the other flash kernels.

Options: GQA/MQA, causal, sliding window, ALiBi (slopes in SMEM, the bias computed in the kernel),
segment ids, the logit soft cap, attention sinks (in SMEM, folded in by finalize; their gradient is
computed outside the kernels from the rows' lse and delta), float32 and bfloat16. Dense bias/mask
arrays are not taken (`layers.attention_pallas` sends those to the blockwise kernel on TPU).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from layers import attention_blockwise as blockwise
from layers import flash_core

LANES = 128  # a vreg is [8, 128]: the lane (last) dimension of every block is a multiple of this
SUBLANES = 8
# jax's TPU flash kernel uses 128 by default; it compiles on every TPU generation. Larger tiles are
# faster on large problems but are untuned here (no TPU measured them).
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128

_NT = (((1,), (1,)), ((), ()))  # a @ b.T without materialising the transpose


def _logits(q, k, i, j, cfg, *, slope=None, q_seg=None, kv_seg=None):
  """Scaled scores `[bq, bk]` (float32) of query tile i and key tile j, -inf where hidden.

  q `[bq, H]`, k `[bk, H]`; slope a scalar; q_seg `[bq, 128]` (lane-replicated), kv_seg `[1, bk]`.
  """
  bq, bk = q.shape[0], k.shape[0]
  if q_seg is not None:
    q_seg = jnp.tile(q_seg, (1, bk // LANES))  # [bq, bk]
  return flash_core.tile_logits(
      lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32),  # [bq, bk]
      # Mosaic has no 1-D iota: positions are [bq, bk] tiles.
      i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0),
      j * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1),
      scale=cfg.scale, is_causal=cfg.is_causal, window=cfg.window,
      kv_len=cfg.kv_len,  # keys past S pad the last tile
      slope=slope, q_seg=q_seg, k_seg=kv_seg, softcap=cfg.softcap)


def _clamp(x, lo, hi, n):
  """x clamped into the band [lo, hi) and into [0, n): a skipped step re-reads the edge block."""
  x = jnp.minimum(jnp.maximum(x, lo), hi - 1)
  return jnp.minimum(jnp.maximum(x, 0), n - 1)


def _pop_options(refs, flags):
  """(slopes_ref, q_seg_ref, kv_seg_ref, rest): the optional inputs (None when absent); the
  sinks' ref, when there is one, leads `rest` (only the forward kernel reads it)."""
  refs = list(refs)
  slopes = refs.pop(0) if flags[0] else None
  q_seg, kv_seg = (refs.pop(0), refs.pop(0)) if flags[1] else (None, None)
  return slopes, q_seg, kv_seg, refs


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg, flags, nk):
  slopes_ref, q_seg_ref, kv_seg_ref, rest = _pop_options(refs, flags)
  sinks_ref = rest.pop(0) if flags[2] else None
  o_ref, lse_ref, m_sc, l_sc, acc_sc = rest
  n, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  lo, hi = blockwise.key_block_band(i, cfg, nk)

  @pl.when((j >= lo) & (j < hi))
  def _step():
    s = _logits(q_ref[...], k_ref[...], i, j, cfg,
                slope=None if slopes_ref is None else slopes_ref[n],
                q_seg=None if q_seg_ref is None else q_seg_ref[...],
                kv_seg=None if kv_seg_ref is None else kv_seg_ref[:1, :])  # [bq, bk]
    # The statistics stay lane-replicated [bq, 128]; flash_core tiles them to the key tile.
    m, l, acc = flash_core.online_update((m_sc[...], l_sc[...], acc_sc[...]), s, v_ref[...])
    m_sc[...], l_sc[...], acc_sc[...] = m, l, acc

  @pl.when(j == nk - 1)
  def _store():
    sink = None if sinks_ref is None else sinks_ref[n]  # a scalar from SMEM
    out, lse = flash_core.finalize((m_sc[...], l_sc[...], acc_sc[...]), sink)  # [bq, H], [bq, 128]
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, nk):
  slopes_ref, q_seg_ref, kv_seg_ref, (dq_ref, dq_sc) = _pop_options(refs, flags)
  n, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  lo, hi = blockwise.key_block_band(i, cfg, nk)

  @pl.when((j >= lo) & (j < hi))
  def _step():
    k = k_ref[...]
    s = _logits(q_ref[...], k, i, j, cfg,
                slope=None if slopes_ref is None else slopes_ref[n],
                q_seg=None if q_seg_ref is None else q_seg_ref[...],
                kv_seg=None if kv_seg_ref is None else kv_seg_ref[:1, :])  # [bq, bk]
    p = flash_core.probabilities(s, lse_ref[...])  # lse = +inf on empty rows: p = 0
    dp = lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=jnp.float32)
    ds = flash_core.ds(p, dp, delta_ref[...], s, cfg.softcap)
    dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  @pl.when(j == nk - 1)
  def _store():
    dq_ref[...] = (cfg.scale * dq_sc[...]).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, nq, groups):
  """dK, dV of key tile j of kv head kk: sums over its G query heads (grid axis 3) and the query
  tiles of its band (grid axis 4)."""
  slopes_ref, q_seg_ref, kv_seg_ref, (dk_ref, dv_ref, dk_sc, dv_sc) = _pop_options(refs, flags)
  kk, j, g, i = pl.program_id(1), pl.program_id(2), pl.program_id(3), pl.program_id(4)

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  lo, hi = blockwise.query_block_band(j, cfg, nq)

  @pl.when((i >= lo) & (i < hi))
  def _step():
    q, do, v = q_ref[...], do_ref[...], v_ref[...]
    s = _logits(q, k_ref[...], i, j, cfg,
                slope=None if slopes_ref is None else slopes_ref[kk * groups + g],
                q_seg=None if q_seg_ref is None else q_seg_ref[...],
                kv_seg=None if kv_seg_ref is None else kv_seg_ref[:1, :])  # [bq, bk]
    p = flash_core.probabilities(s, lse_ref[...])  # [bq, bk]
    # Transposes in float32, then the cast: jax's TPU kernel's order (32-bit transposes lower on
    # every TPU generation).
    dv_sc[...] += jnp.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    ds = flash_core.ds(p, dp, delta_ref[...], s, cfg.softcap)
    dk_sc[...] += jnp.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)

  @pl.when((g == groups - 1) & (i == nq - 1))
  def _store():
    dk_ref[...] = (cfg.scale * dk_sc[...]).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, semantics, interpret, name):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=grid, in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
      # Pallas's TPU interpreter runs the same kernel on CPU, with VMEM/SMEM scratch that persists
      # along the grid's sequential order, as on the chip.
      interpret=pltpu.InterpretParams() if interpret else False,
      name=name)


def _extra_specs(extra, bq, bk, q_map, kv_map):
  """Specs of slopes (all of it, in SMEM), q segments `[bq, 128]` and kv segments `[8, bk]`."""
  specs = []
  if extra['slopes'] is not None:
    specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
  if extra['q_seg'] is not None:
    specs += [pl.BlockSpec((None, bq, LANES), q_map), pl.BlockSpec((None, SUBLANES, bk), kv_map)]
  return specs


def _extra_args(extra):
  args = [] if extra['slopes'] is None else [extra['slopes']]
  return args if extra['q_seg'] is None else args + [extra['q_seg'], extra['kv_seg']]


def _flags(extra):
  """(slopes, segment ids, sinks) present; only the forward is given the sinks."""
  return (extra['slopes'] is not None, extra['q_seg'] is not None, extra['sinks'] is not None)


def _lanes(x):
  """`[..., L]` -> `[..., L, 128]`: a per-row statistic replicated over a vreg's lanes."""
  return jnp.broadcast_to(x[..., None], x.shape + (LANES,))


def _forward(static, q, k, v, extra):
  """q `[B, N, Tp, H]`, k/v `[B, K, Sp, H]` -> out `[B, N, Tp, H]` float32, lse `[B, N, Tp]`.

  static: (TileConfig, interpret).
  """
  cfg, interpret = static
  b, n, tp, h = q.shape
  kh, sp = k.shape[1], k.shape[2]
  g, bq, bk = n // kh, cfg.block_q, cfg.block_k
  nq, nk = tp // bq, sp // bk

  def kv_block(i, j):
    lo, hi = blockwise.key_block_band(i, cfg, nk)
    return _clamp(j, lo, hi, nk)

  q_spec = pl.BlockSpec((None, None, bq, h), lambda bb, nn, i, j: (bb, nn, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, h),
                         lambda bb, nn, i, j: (bb, lax.div(nn, g), kv_block(i, j), 0))
  row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bb, nn, i, j: (bb, nn, i, 0))
  extra_specs = _extra_specs(extra, bq, bk, lambda bb, nn, i, j: (bb, i, 0),
                            lambda bb, nn, i, j: (bb, 0, kv_block(i, j)))
  sinks = [] if extra['sinks'] is None else [extra['sinks']]  # [N] in SMEM
  out, lse = _call(
      functools.partial(_fwd_kernel, cfg=cfg, flags=_flags(extra), nk=nk), (b, n, nq, nk),
      [q_spec, kv_spec, kv_spec] + extra_specs
      + [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(sinks), [q_spec, row_spec],
      [jax.ShapeDtypeStruct((b, n, tp, h), jnp.float32),
       jax.ShapeDtypeStruct((b, n, tp, LANES), jnp.float32)],
      [pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
       pltpu.VMEM((bq, h), jnp.float32)],
      ('parallel', 'parallel', 'parallel', 'arbitrary'), interpret, 'flash_forward_tpu',
  )(q, k, v, *_extra_args(extra), *sinks)
  return out, lse[..., 0]


def _backward(static, args, out, lse, d_out):
  """The dQ and dK/dV kernels: cotangents of (q, k, v, extra)."""
  cfg, interpret = static
  q, k, v, extra = args
  b, n, tp, h = q.shape
  kh, sp = k.shape[1], k.shape[2]
  g, bq, bk = n // kh, cfg.block_q, cfg.block_k
  nq, nk = tp // bq, sp // bk
  flags = _flags(extra)[:2]  # the backward kernels read no sinks
  delta = flash_core.backward_delta(out, d_out)  # [B, N, Tp]
  d_extra = {name: None for name in extra}  # slopes and segment ids: no gradient
  if extra['sinks'] is not None:
    d_extra['sinks'] = flash_core.sink_grad(extra['sinks'][:, None], lse, delta, (0, 2))  # [N]
  delta, lse = _lanes(delta), _lanes(lse)  # [B, N, Tp, 128] each
  do = d_out.astype(q.dtype)

  def kv_block(i, j):
    lo, hi = blockwise.key_block_band(i, cfg, nk)
    return _clamp(j, lo, hi, nk)

  q_spec = pl.BlockSpec((None, None, bq, h), lambda bb, nn, i, j: (bb, nn, i, 0))
  row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bb, nn, i, j: (bb, nn, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, h),
                         lambda bb, nn, i, j: (bb, lax.div(nn, g), kv_block(i, j), 0))
  dq = _call(
      functools.partial(_dq_kernel, cfg=cfg, flags=flags, nk=nk), (b, n, nq, nk),
      [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + _extra_specs(
          extra, bq, bk, lambda bb, nn, i, j: (bb, i, 0),
          lambda bb, nn, i, j: (bb, 0, kv_block(i, j))),
      q_spec, jax.ShapeDtypeStruct(q.shape, jnp.float32), [pltpu.VMEM((bq, h), jnp.float32)],
      ('parallel', 'parallel', 'parallel', 'arbitrary'), interpret, 'flash_dq_tpu',
  )(q, k, v, do, lse, delta, *_extra_args(extra))

  # Grid (b, kv head kk, key tile j, query head g of the group, query tile i): the G query heads
  # of kv head kk are the kk-th group of G consecutive heads; both inner axes accumulate.
  def q_block(j, i):
    lo, hi = blockwise.query_block_band(j, cfg, nq)
    return _clamp(i, lo, hi, nq)

  qg_spec = pl.BlockSpec((None, None, bq, h),
                         lambda bb, kk, j, gg, i: (bb, kk * g + gg, q_block(j, i), 0))
  rowg_spec = pl.BlockSpec((None, None, bq, LANES),
                           lambda bb, kk, j, gg, i: (bb, kk * g + gg, q_block(j, i), 0))
  kt_spec = pl.BlockSpec((None, None, bk, h), lambda bb, kk, j, gg, i: (bb, kk, j, 0))
  dk, dv = _call(
      functools.partial(_dkv_kernel, cfg=cfg, flags=flags, nq=nq, groups=g), (b, kh, nk, g, nq),
      [qg_spec, kt_spec, kt_spec, qg_spec, rowg_spec, rowg_spec] + _extra_specs(
          extra, bq, bk, lambda bb, kk, j, gg, i: (bb, q_block(j, i), 0),
          lambda bb, kk, j, gg, i: (bb, 0, j)),
      [kt_spec, kt_spec],
      [jax.ShapeDtypeStruct(k.shape, jnp.float32), jax.ShapeDtypeStruct(v.shape, jnp.float32)],
      [pltpu.VMEM((bk, h), jnp.float32), pltpu.VMEM((bk, h), jnp.float32)],
      ('parallel', 'parallel', 'parallel', 'arbitrary', 'arbitrary'), interpret, 'flash_dkv_tpu',
  )(q, k, v, do, lse, delta, *_extra_args(extra))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_extra


_flash = flash_core.flash_vjp(_forward, _backward)  # _flash((cfg, interpret), q, k, v, extra)


def _round_up(x, m):
  return -(-x // m) * m


def attention(query, key, value, *, scale, is_causal=False, window=None, alibi_slopes=None,
              q_segment_ids=None, kv_segment_ids=None, softcap=None, sinks=None,
              block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, interpret=False):
  """Mosaic TPU FlashAttention-2; arguments as `attention_blockwise.attention` less bias and mask.

  Args:
    query: `[B, T, N, H]`; key, value: `[B, S, K, H]`, N a multiple of K.
    scale, is_causal, window, alibi_slopes, q_segment_ids, kv_segment_ids, softcap, sinks: as in
      `layers.attention.dot_product_attention` (window already normalised to (left, right)).
    block_q, block_k: tile sizes, multiples of 128 (shrunk to the padded length when it is less).
    interpret: run in Pallas's TPU interpret mode (on any backend; the numerics tests on CPU).

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  if block_q % LANES or block_k % LANES:
    raise ValueError(f'TPU tiles must be multiples of {LANES}; got {block_q}, {block_k}')
  b, t, n, h = query.shape
  s = key.shape[1]
  # Lengths are padded to whole tiles; padded keys are masked (k_pos < S) and padded query rows
  # are dropped, and their zero cotangent adds nothing to dK/dV: results are exact.
  bq, bk = min(block_q, _round_up(t, LANES)), min(block_k, _round_up(s, LANES))
  tp, sp = _round_up(t, bq), _round_up(s, bk)
  cfg = blockwise.TileConfig(float(scale), bool(is_causal),
                             None if window is None else tuple(window), t, s, bq, bk,
                             softcap=float(softcap or 0.0))
  pad = flash_core.pad_axis
  # A head dim above 128 is padded to whole lanes (the statistics are tiled to it): zero features
  # add nothing to q·k, and v's zero columns give output columns that are dropped.
  hp = h if h <= LANES else _round_up(h, LANES)
  q = pad(pad(query, 1, tp), 3, hp).transpose(0, 2, 1, 3)  # [B, N, Tp, Hp]
  k = pad(pad(key, 1, sp), 3, hp).transpose(0, 2, 1, 3)  # [B, K, Sp, Hp]
  v = pad(pad(value, 1, sp), 3, hp).transpose(0, 2, 1, 3)  # [B, K, Sp, Hp]
  extra = {'slopes': None, 'q_seg': None, 'kv_seg': None, 'sinks': None}
  if alibi_slopes is not None:
    extra['slopes'] = lax.stop_gradient(alibi_slopes.astype(jnp.float32))  # [N]
  if sinks is not None:
    extra['sinks'] = sinks.astype(jnp.float32)  # [N], differentiated
  if q_segment_ids is not None:
    # Mosaic layouts: query ids replicated over 128 lanes, key ids over 8 sublanes.
    q_seg = pad(q_segment_ids.astype(jnp.int32), 1, tp)  # [B, Tp]
    kv_seg = pad(kv_segment_ids.astype(jnp.int32), 1, sp)  # [B, Sp]
    extra['q_seg'] = jnp.broadcast_to(q_seg[:, :, None], (b, tp, LANES))
    extra['kv_seg'] = jnp.broadcast_to(kv_seg[:, None, :], (b, SUBLANES, sp))
  out = _flash((cfg, bool(interpret)), q, k, v, extra)  # [B, N, Tp, Hp] float32
  return out[:, :, :t, :h].transpose(0, 2, 1, 3).astype(query.dtype)
