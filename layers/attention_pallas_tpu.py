"""FlashAttention-2 as Mosaic TPU Pallas kernels (forward, dQ, dK/dV) with a custom VJP.

Written the way Mosaic wants it (jax's pallas/ops/tpu/flash_attention.py is the model): every
block's last two dimensions are multiples of (8, 128) or the whole array dimension; the loop over
the other sequence is the last grid dimension, marked "arbitrary", so that the running max, sum and
output accumulate in VMEM scratch across its steps; per-row statistics are kept 128 lanes wide (one
vreg row) and tiled to the key tile's width. Tiles outside the causal/window band
(`layers.flash_core.key_block_band`) are skipped: their step does no work (`pl.when`) and their
index map repeats the band's edge block, so the pipeline fetches nothing new for them.

The tile logits, the online update and finalize (on statistics in that lane layout), the tile
gradients and the custom VJP are `layers.flash_core`'s, shared with the other flash kernels; the
host side shares `layers.attention_pallas_host` with the Triton kernel.

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

from layers import attention_pallas_host as host
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
      flash_core.tile_dot(q, k, _NT),  # [bq, bk]
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


# The optional inputs, in the order of the kernels' refs and of `_extra_specs` (the backward
# kernels take all but the sinks, whose gradient is computed outside them).
_NAMES = ('slopes', 'q_seg', 'kv_seg', 'sinks')


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg, flags, nk):
  extra, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = host.unpack(refs, flags)
  slopes_ref, q_seg_ref, kv_seg_ref, sinks_ref = (extra[name] for name in _NAMES)
  n, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  lo, hi = flash_core.key_block_band(i, cfg, nk)

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
  extra, (dq_ref, dq_sc) = host.unpack(refs, flags)
  slopes_ref, q_seg_ref, kv_seg_ref = (extra[name] for name in _NAMES[:3])
  n, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

  lo, hi = flash_core.key_block_band(i, cfg, nk)

  @pl.when((j >= lo) & (j < hi))
  def _step():
    q, k = q_ref[...], k_ref[...]  # [bq, H], [bk, H]
    s = _logits(q, k, i, j, cfg,
                slope=None if slopes_ref is None else slopes_ref[n],
                q_seg=None if q_seg_ref is None else q_seg_ref[...],
                kv_seg=None if kv_seg_ref is None else kv_seg_ref[:1, :])  # [bq, bk]
    # lse = +inf on empty rows: p = 0. The scale multiplies the sum once, at the store.
    dq_sc[...] += flash_core.tile_grads(s, lse_ref[...], delta_ref[...], q, k, v_ref[...],
                                        do_ref[...], softcap=cfg.softcap, dkv=False).dq

  @pl.when(j == nk - 1)
  def _store():
    dq_ref[...] = (cfg.scale * dq_sc[...]).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, nq, groups):
  """dK, dV of key tile j of kv head kk: sums over its G query heads (grid axis 3) and the query
  tiles of its band (grid axis 4)."""
  extra, (dk_ref, dv_ref, dk_sc, dv_sc) = host.unpack(refs, flags)
  slopes_ref, q_seg_ref, kv_seg_ref = (extra[name] for name in _NAMES[:3])
  kk, j, g, i = pl.program_id(1), pl.program_id(2), pl.program_id(3), pl.program_id(4)

  @pl.when((g == 0) & (i == 0))
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

  lo, hi = flash_core.query_block_band(j, cfg, nq)

  @pl.when((i >= lo) & (i < hi))
  def _step():
    q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]  # [bq|bk, H]
    s = _logits(q, k, i, j, cfg,
                slope=None if slopes_ref is None else slopes_ref[kk * groups + g],
                q_seg=None if q_seg_ref is None else q_seg_ref[...],
                kv_seg=None if kv_seg_ref is None else kv_seg_ref[:1, :])  # [bq, bk]
    # Statistics lane-replicated [bq, 128]; Pᵀ and dSᵀ transposed in float32 (flash_core).
    grads = flash_core.tile_grads(s, lse_ref[...], delta_ref[...], q, k, v, do,
                                  softcap=cfg.softcap, dq=False)  # [bk, H] each
    dv_sc[...] += grads.dv
    dk_sc[...] += grads.dk

  @pl.when((g == groups - 1) & (i == nq - 1))
  def _store():
    dk_ref[...] = (cfg.scale * dk_sc[...]).astype(dk_ref.dtype)
    dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, scratch, semantics, interpret, name, cost):
  # Pallas's TPU interpreter runs the same kernel on CPU, with VMEM/SMEM scratch that persists
  # along the grid's sequential order, as on the chip.
  return host.call(kernel, grid, in_specs, out_specs, out_shape, name, scratch=scratch,
                   params=pltpu.CompilerParams(dimension_semantics=semantics),
                   interpret=pltpu.InterpretParams() if interpret else False, cost=cost)


def _extra_specs(flags, bq, bk, q_map, kv_map):
  """Specs of the optional inputs in `flags`: slopes and sinks (all of them, in SMEM), q segments
  `[bq, 128]` and kv segments `[8, bk]`."""
  specs = {'slopes': pl.BlockSpec(memory_space=pltpu.SMEM),
           'q_seg': pl.BlockSpec((None, bq, LANES), q_map),
           'kv_seg': pl.BlockSpec((None, SUBLANES, bk), kv_map),
           'sinks': pl.BlockSpec(memory_space=pltpu.SMEM)}
  return [specs[name] for name, given in flags.items() if given]


def _lanes(x):
  """`[..., L]` -> `[..., L, 128]`: a per-row statistic replicated over a vreg's lanes."""
  return jnp.broadcast_to(x[..., None], x.shape + (LANES,))


def _forward(static, q, k, v, extra):
  """q `[B, N, Tp, H]`, k/v `[B, K, Sp, H]` -> out `[B, N, Tp, H]` float32, lse `[B, N, Tp]`.

  static: (TileConfig, interpret).
  """
  cfg, interpret = static
  d = host.dims(cfg, q, k)
  bq, bk = cfg.block_q, cfg.block_k
  flags = host.flags(extra, _NAMES)

  def kv_block(i, j):
    lo, hi = flash_core.key_block_band(i, cfg, d.nk)
    return _clamp(j, lo, hi, d.nk)

  q_spec = pl.BlockSpec((None, None, bq, d.h), lambda bb, nn, i, j: (bb, nn, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, d.h),
                         lambda bb, nn, i, j: (bb, lax.div(nn, d.g), kv_block(i, j), 0))
  row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bb, nn, i, j: (bb, nn, i, 0))
  extra_specs = _extra_specs(flags, bq, bk, lambda bb, nn, i, j: (bb, i, 0),
                             lambda bb, nn, i, j: (bb, 0, kv_block(i, j)))
  out, lse = _call(
      functools.partial(_fwd_kernel, cfg=cfg, flags=flags, nk=d.nk), (d.b, d.n, d.nq, d.nk),
      [q_spec, kv_spec, kv_spec] + extra_specs, [q_spec, row_spec],
      [jax.ShapeDtypeStruct((d.b, d.n, d.tp, d.h), jnp.float32),
       jax.ShapeDtypeStruct((d.b, d.n, d.tp, LANES), jnp.float32)],
      [pltpu.VMEM((bq, LANES), jnp.float32), pltpu.VMEM((bq, LANES), jnp.float32),
       pltpu.VMEM((bq, d.h), jnp.float32)],
      ('parallel', 'parallel', 'parallel', 'arbitrary'), interpret, 'flash_forward_tpu',
      host.cost_estimate(cfg, d, 'forward', q.dtype.itemsize, once=2, per_tile=2),
  )(q, k, v, *host.present(extra, flags))
  return out, lse[..., 0]


def _dq(cfg, interpret, d, flags, inputs):
  """The dQ kernel: grid (b, head, query tile i, key tile j), j accumulating over i's band."""
  bq, bk = cfg.block_q, cfg.block_k

  def kv_block(i, j):
    lo, hi = flash_core.key_block_band(i, cfg, d.nk)
    return _clamp(j, lo, hi, d.nk)

  q_spec = pl.BlockSpec((None, None, bq, d.h), lambda bb, nn, i, j: (bb, nn, i, 0))
  row_spec = pl.BlockSpec((None, None, bq, LANES), lambda bb, nn, i, j: (bb, nn, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, d.h),
                         lambda bb, nn, i, j: (bb, lax.div(nn, d.g), kv_block(i, j), 0))
  return _call(
      functools.partial(_dq_kernel, cfg=cfg, flags=flags, nk=d.nk), (d.b, d.n, d.nq, d.nk),
      [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + _extra_specs(
          flags, bq, bk, lambda bb, nn, i, j: (bb, i, 0),
          lambda bb, nn, i, j: (bb, 0, kv_block(i, j))),
      q_spec, jax.ShapeDtypeStruct(inputs[0].shape, jnp.float32),
      [pltpu.VMEM((bq, d.h), jnp.float32)],
      ('parallel', 'parallel', 'parallel', 'arbitrary'), interpret, 'flash_dq_tpu',
      host.cost_estimate(cfg, d, 'dq', inputs[0].dtype.itemsize, once=3, per_tile=2),
  )(*inputs)


def _dkv(cfg, interpret, d, flags, inputs):
  """The dK/dV kernel: grid (b, kv head kk, key tile j, query head g of the group, query tile i):
  the G query heads of kv head kk are the kk-th group of G consecutive heads; both inner axes
  accumulate."""
  bq, bk = cfg.block_q, cfg.block_k

  def q_block(j, i):
    lo, hi = flash_core.query_block_band(j, cfg, d.nq)
    return _clamp(i, lo, hi, d.nq)

  qg_spec = pl.BlockSpec((None, None, bq, d.h),
                         lambda bb, kk, j, gg, i: (bb, kk * d.g + gg, q_block(j, i), 0))
  rowg_spec = pl.BlockSpec((None, None, bq, LANES),
                           lambda bb, kk, j, gg, i: (bb, kk * d.g + gg, q_block(j, i), 0))
  kt_spec = pl.BlockSpec((None, None, bk, d.h), lambda bb, kk, j, gg, i: (bb, kk, j, 0))
  kv_shape = jax.ShapeDtypeStruct((d.b, d.kh, d.sp, d.h), jnp.float32)
  return _call(
      functools.partial(_dkv_kernel, cfg=cfg, flags=flags, nq=d.nq, groups=d.g),
      (d.b, d.kh, d.nk, d.g, d.nq),
      [qg_spec, kt_spec, kt_spec, qg_spec, rowg_spec, rowg_spec] + _extra_specs(
          flags, bq, bk, lambda bb, kk, j, gg, i: (bb, q_block(j, i), 0),
          lambda bb, kk, j, gg, i: (bb, 0, j)),
      [kt_spec, kt_spec], [kv_shape, kv_shape],
      [pltpu.VMEM((bk, d.h), jnp.float32), pltpu.VMEM((bk, d.h), jnp.float32)],
      ('parallel', 'parallel', 'parallel', 'arbitrary', 'arbitrary'), interpret, 'flash_dkv_tpu',
      host.cost_estimate(cfg, d, 'dkv', inputs[0].dtype.itemsize, once=4, per_tile=2),
  )(*inputs)


def _backward(static, args, out, lse, d_out):
  """The dQ and dK/dV kernels: cotangents of (q, k, v, extra)."""
  cfg, interpret = static
  q, k, v, extra = args
  d = host.dims(cfg, q, k)
  delta, do, d_extra = host.backward_rows(extra, out, lse, d_out, q.dtype)  # delta [B, N, Tp]
  flags = host.flags(extra, _NAMES[:3])  # the backward kernels read no sinks
  inputs = (q, k, v, do, _lanes(lse), _lanes(delta), *host.present(extra, flags))  # [.., 128]
  dq = _dq(cfg, interpret, d, flags, inputs)
  dk, dv = _dkv(cfg, interpret, d, flags, inputs)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_extra


_flash = flash_core.flash_vjp(_forward, _backward)  # _flash((cfg, interpret), q, k, v, extra)


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
  # Tiles and a head dim above 128 are whole lanes (the statistics are tiled to the head dim).
  cfg, q, k, v = host.tiled(
      query, key, value, scale=scale, is_causal=is_causal, window=window, softcap=softcap,
      block_q=block_q, block_k=block_k, fit_len=lambda x: host.round_up(x, LANES),
      fit_width=lambda h: h if h <= LANES else host.round_up(h, LANES))
  b, tp, sp = query.shape[0], q.shape[2], k.shape[2]
  extra = host.per_head(alibi_slopes, sinks)  # [N] each, in SMEM
  extra['q_seg'] = extra['kv_seg'] = None
  if q_segment_ids is not None:
    # Mosaic layouts: query ids replicated over 128 lanes, key ids over 8 sublanes.
    q_seg = flash_core.pad_axis(q_segment_ids.astype(jnp.int32), 1, tp)  # [B, Tp]
    kv_seg = flash_core.pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp)  # [B, Sp]
    extra['q_seg'] = jnp.broadcast_to(q_seg[:, :, None], (b, tp, LANES))
    extra['kv_seg'] = jnp.broadcast_to(kv_seg[:, None, :], (b, SUBLANES, sp))
  return host.untiled(_flash((cfg, bool(interpret)), q, k, v, extra), query)  # [B, T, N, H]
