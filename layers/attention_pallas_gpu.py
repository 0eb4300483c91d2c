"""FlashAttention-2 as Triton Pallas kernels (forward, dQ, dK/dV) for GPU, or interpreted anywhere.

`layers.attention_pallas` picks this kernel for cuda/rocm (and its interpreter for platforms other
than tpu). The visible-block bands, the tile logits (visibility from `layers.masks`), the online
softmax, its finalize, the tile gradients and the custom VJP are `layers.flash_core`'s, evaluated on
each 2-D `[bq, bk]` tile; the host side shares `layers.attention_pallas_host` with the Mosaic
kernel. One program handles one (batch, head, block) tile; loops over the other sequence run inside
the kernel over the band only, and the dK/dV kernel sums the G query heads of its key/value head.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from layers import attention_pallas_host as host
from layers import flash_core

# Tile sizes (powers of two for the GPU lowering, which wants power-of-two tensor shapes).
DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


def _tile_logits(q, k, i, j, cfg, *, bias=None, mask=None, slope=None, q_seg=None, kv_seg=None):
  """Scaled, biased scores `[bq, bk]` (float32) of query tile i and key tile j, -inf where hidden.

  q `[bq, H]`, k `[bk, H]`; bias `[bq, bk]`; mask int8 `[bq, bk]`; slope `[1]`; segs `[bq]`, `[bk]`.
  """
  bq, bk = q.shape[0], k.shape[0]
  return flash_core.tile_logits(
      flash_core.tile_dot(q, k, (((1,), (1,)), ((), ()))),  # [bq, bk]
      i * cfg.block_q + lax.broadcasted_iota(jnp.int32, (bq, 1), 0),  # [bq, 1]
      j * cfg.block_k + lax.broadcasted_iota(jnp.int32, (1, bk), 1),  # [1, bk]
      scale=cfg.scale, is_causal=cfg.is_causal, window=cfg.window,
      kv_len=cfg.kv_len,  # keys past S pad the last tile
      bias=bias, slope=slope, q_seg=None if q_seg is None else q_seg[:, None],
      k_seg=None if kv_seg is None else kv_seg[None, :], mask=None if mask is None else mask != 0,
      softcap=cfg.softcap)


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg, flags, num_k_blocks):
  extra, (o_ref, lse_ref) = host.unpack(refs, flags)
  i = pl.program_id(2)
  q = q_ref[...]  # [bq, H]
  q_seg = None if extra['q_seg'] is None else extra['q_seg'][...]
  slope = None if extra['slopes'] is None else extra['slopes'][...]
  bk = cfg.block_k

  def body(j, carry):
    cols = pl.ds(j * bk, bk)
    s = _tile_logits(
        q, k_ref[cols, :], i, j, cfg,
        bias=None if extra['bias'] is None else extra['bias'][:, cols],
        mask=None if extra['mask'] is None else extra['mask'][:, cols], slope=slope, q_seg=q_seg,
        kv_seg=None if extra['kv_seg'] is None else extra['kv_seg'][cols])  # [bq, bk]
    return flash_core.online_update(carry, s, v_ref[cols, :])

  lo, hi = flash_core.key_block_band(i, cfg, num_k_blocks)
  carry = lax.fori_loop(lo, hi, body, flash_core.init_carry((q.shape[0],), v_ref.shape[-1]))
  sink = None if extra['sinks'] is None else extra['sinks'][...]  # [1], this head's
  out, lse = flash_core.finalize(carry, sink)  # [bq, H], [bq]
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = lse


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, num_k_blocks):
  extra, (dq_ref,) = host.unpack(refs, flags)
  i = pl.program_id(2)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]  # [bq, H], [bq]
  q_seg = None if extra['q_seg'] is None else extra['q_seg'][...]
  slope = None if extra['slopes'] is None else extra['slopes'][...]
  bk = cfg.block_k

  def body(j, dq):
    cols = pl.ds(j * bk, bk)
    k = k_ref[cols, :]
    s = _tile_logits(
        q, k, i, j, cfg, bias=None if extra['bias'] is None else extra['bias'][:, cols],
        mask=None if extra['mask'] is None else extra['mask'][:, cols], slope=slope, q_seg=q_seg,
        kv_seg=None if extra['kv_seg'] is None else extra['kv_seg'][cols])
    # lse = +inf on empty rows: p = 0. The scale multiplies the sum once, after the loop.
    return dq + flash_core.tile_grads(s, lse, delta, q, k, v_ref[cols, :], do,
                                      softcap=cfg.softcap, dkv=False).dq

  lo, hi = flash_core.key_block_band(i, cfg, num_k_blocks)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (cfg.scale * dq).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, num_q_blocks,
                groups, bias_per_head):
  """dK, dV of one key tile of kv head kk: sums over its G query heads and their query band."""
  extra, out_refs = host.unpack(refs, flags)
  dk_ref, dv_ref = out_refs[:2]
  dbias_ref = out_refs[2] if flags['bias'] else None
  j = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]  # [bk, H]
  kv_seg = None if extra['kv_seg'] is None else extra['kv_seg'][...]
  bq = cfg.block_q
  if dbias_ref is not None:
    # Tiles outside the band get no visit; their bias gradient is zero.
    dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)
  lo, hi = flash_core.query_block_band(j, cfg, num_q_blocks)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for g in range(groups):  # static: G query heads share this kv head

    def body(i, carry, g=g):
      dk, dv = carry
      rows = pl.ds(i * bq, bq)
      q = q_ref[g, rows, :]
      do = do_ref[g, rows, :]
      bias = None
      if extra['bias'] is not None:
        bias = extra['bias'][g, rows, :] if bias_per_head else extra['bias'][rows, :]
      mask = None
      if extra['mask'] is not None:
        mask = extra['mask'][g, rows, :] if bias_per_head else extra['mask'][rows, :]
      s = _tile_logits(
          q, k, i, j, cfg, bias=bias, mask=mask,
          slope=None if extra['slopes'] is None else extra['slopes'][pl.ds(g, 1)],
          q_seg=None if extra['q_seg'] is None else extra['q_seg'][rows], kv_seg=kv_seg)
      grads = flash_core.tile_grads(s, lse_ref[g, rows], delta_ref[g, rows], q, k, v, do,
                                    softcap=cfg.softcap, dq=False)  # [bk, H] each
      if dbias_ref is not None:
        dbias_ref[g, rows, :] = grads.ds
      return dk + grads.dk, dv + grads.dv

    dk, dv = lax.fori_loop(lo, hi, body, (dk, dv))
  dk_ref[...] = (cfg.scale * dk).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, name, backend, cost):
  """backend 'triton' (GPU lowering) or 'interpret' (any platform, the CPU tests); cost: the
  call's `pl.CostEstimate` (host.cost_estimate)."""
  params = None
  if backend == 'triton':
    from jax.experimental.pallas import triton as plgpu
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
  return host.call(kernel, grid, in_specs, out_specs, out_shape, name, params=params,
                   interpret=backend == 'interpret', cost=cost)


def _extra_specs(extra, g, bq, bk, per_q_tile):
  """BlockSpecs of the optional inputs for a grid (b, n, i) over query tiles or (b, kk, j) key
  tiles.

  `per_q_tile`: the forward/dQ grid (one query tile, all keys) versus dK/dV (one key tile, all
  queries of the G heads of kv head kk).
  """
  specs = []
  for name in ('bias', 'mask'):
    x = extra[name]
    if x is None:
      continue
    b1, n1, tp, sp = x.shape
    bsel = (lambda b: b) if b1 > 1 else (lambda b: 0)
    if per_q_tile:
      nsel = (lambda n: n) if n1 > 1 else (lambda n: 0)
      specs.append(pl.BlockSpec((None, None, bq, sp),
                                lambda b, n, i, bsel=bsel, nsel=nsel: (bsel(b), nsel(n), i, 0)))
    elif n1 > 1:
      specs.append(pl.BlockSpec((None, g, tp, bk),
                                lambda b, kk, j, bsel=bsel: (bsel(b), kk, 0, j)))
    else:
      specs.append(pl.BlockSpec((None, None, tp, bk),
                                lambda b, kk, j, bsel=bsel: (bsel(b), 0, 0, j)))
  for name in ('slopes', 'sinks'):  # per query head: the tile's one, or the G of kv head kk
    if extra[name] is None:
      continue
    if per_q_tile:
      specs.append(pl.BlockSpec((1,), lambda b, n, i: (n,)))
    else:
      specs.append(pl.BlockSpec((g,), lambda b, kk, j: (kk,)))
  if extra['q_seg'] is not None:
    tp, sp = extra['q_seg'].shape[1], extra['kv_seg'].shape[1]
    if per_q_tile:
      specs += [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                pl.BlockSpec((None, sp), lambda b, n, i: (b, 0))]
    else:
      specs += [pl.BlockSpec((None, tp), lambda b, kk, j: (b, 0)),
                pl.BlockSpec((None, bk), lambda b, kk, j: (b, j))]
  return specs


# The optional inputs, in the order of the kernels' refs and of `_extra_specs`.
_NAMES = ('bias', 'mask', 'slopes', 'sinks', 'q_seg', 'kv_seg')


def _forward(static, q, k, v, extra):
  """q `[B, N, Tp, H]`, k/v `[B, K, Sp, H]` -> out `[B, N, Tp, H]` float32, lse `[B, N, Tp]`.

  static: (TileConfig, backend).
  """
  cfg, backend = static
  d = host.dims(cfg, q, k)
  flags = host.flags(extra, _NAMES)
  kv_spec = pl.BlockSpec((None, None, d.sp, d.h), lambda bb, nn, i: (bb, lax.div(nn, d.g), 0, 0))
  q_spec = pl.BlockSpec((None, None, cfg.block_q, d.h), lambda bb, nn, i: (bb, nn, i, 0))
  kernel = functools.partial(_fwd_kernel, cfg=cfg, flags=flags, num_k_blocks=d.nk)
  return _call(
      kernel, (d.b, d.n, d.nq),
      [q_spec, kv_spec, kv_spec] + _extra_specs(extra, d.g, cfg.block_q, cfg.block_k, True),
      [q_spec, pl.BlockSpec((None, None, cfg.block_q), lambda bb, nn, i: (bb, nn, i))],
      [jax.ShapeDtypeStruct((d.b, d.n, d.tp, v.shape[-1]), jnp.float32),
       jax.ShapeDtypeStruct((d.b, d.n, d.tp), jnp.float32)], 'flash_forward', backend,
      host.cost_estimate(cfg, d, 'forward', q.dtype.itemsize, once=2, per_tile=2),
  )(q, k, v, *host.present(extra, flags))


def _bias_grad(extra, dbias):
  """The dense bias's gradient `[b, N|1, Tp, Sp]` from the kernel's `[B, N, Tp, Sp]` dS: summed
  over the axes the bias broadcasts along."""
  b1, n1 = extra['bias'].shape[:2]
  dbias = dbias if b1 > 1 else dbias.sum(0, keepdims=True)
  return dbias if n1 > 1 else dbias.sum(1, keepdims=True)


def _backward(static, args, out, lse, d_out):
  """The dQ and dK/dV kernels: cotangents of (q, k, v, extra), the bias's only in `extra`."""
  cfg, backend = static
  q, k, v, extra = args
  d = host.dims(cfg, q, k)
  g, bq, bk = d.g, cfg.block_q, cfg.block_k
  delta, do, d_extra = host.backward_rows(extra, out, lse, d_out, q.dtype)  # delta [B, N, Tp]
  flags = host.flags(extra, _NAMES)
  inputs = (q, k, v, do, lse, delta, *host.present(extra, flags))

  q_spec = pl.BlockSpec((None, None, bq, d.h), lambda bb, nn, i: (bb, nn, i, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda bb, nn, i: (bb, nn, i))
  kv_spec = pl.BlockSpec((None, None, d.sp, d.h), lambda bb, nn, i: (bb, lax.div(nn, g), 0, 0))
  dq = _call(
      functools.partial(_dq_kernel, cfg=cfg, flags=flags, num_k_blocks=d.nk), (d.b, d.n, d.nq),
      [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + _extra_specs(extra, g, bq, bk,
                                                                            True),
      q_spec, jax.ShapeDtypeStruct(q.shape, jnp.float32), 'flash_dq', backend,
      host.cost_estimate(cfg, d, 'dq', q.dtype.itemsize, once=3, per_tile=2),
  )(*inputs)

  # The G query heads of kv head kk are the kk-th group of G consecutive heads.
  qg_spec = pl.BlockSpec((None, g, d.tp, d.h), lambda bb, kk, j: (bb, kk, 0, 0))
  rowg_spec = pl.BlockSpec((None, g, d.tp), lambda bb, kk, j: (bb, kk, 0))
  kt_spec = pl.BlockSpec((None, None, bk, d.h), lambda bb, kk, j: (bb, kk, j, 0))
  out_specs = [kt_spec, kt_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.shape, jnp.float32)]
  if flags['bias']:
    # ds of every (head, query, key): the bias is dense in T and S, so is its gradient.
    out_specs.append(pl.BlockSpec((None, g, d.tp, bk), lambda bb, kk, j: (bb, kk, 0, j)))
    out_shape.append(jax.ShapeDtypeStruct((d.b, d.n, d.tp, d.sp), jnp.float32))
  bias_per_head = extra['bias'] is not None and extra['bias'].shape[1] > 1
  if extra['mask'] is not None:
    bias_per_head = extra['mask'].shape[1] > 1
  if extra['bias'] is not None and extra['mask'] is not None:
    assert extra['bias'].shape[1] == extra['mask'].shape[1]
  res = _call(
      functools.partial(_dkv_kernel, cfg=cfg, flags=flags, num_q_blocks=d.nq, groups=g,
                        bias_per_head=bias_per_head),
      (d.b, d.kh, d.nk),
      [qg_spec, kt_spec, kt_spec, qg_spec, rowg_spec, rowg_spec] + _extra_specs(extra, g, bq,
                                                                                bk, False),
      out_specs, out_shape, 'flash_dkv', backend,
      host.cost_estimate(cfg, d, 'dkv', q.dtype.itemsize, once=4, per_tile=2),
  )(*inputs)
  if flags['bias']:
    d_extra['bias'] = _bias_grad(extra, res[2])
  return dq.astype(q.dtype), res[0].astype(k.dtype), res[1].astype(v.dtype), d_extra


_flash = flash_core.flash_vjp(_forward, _backward)  # _flash((cfg, backend), q, k, v, extra)


def _dense_inputs(bias, mask, t, s, tp, sp):
  """The bias (float32) and mask (int8: boolean refs do not lower everywhere) as `[b, N|1, Tp,
  Sp]`: batch and head axes stay broadcast (index maps pick block 0), the sequence axes are
  materialised so that every tile has the same static shape; bias and mask share one head axis."""
  as4 = lambda x: x.reshape((1,) * (4 - x.ndim) + x.shape)
  n1 = max([1] + [as4(x).shape[1] for x in (bias, mask) if x is not None])

  def dense(x, dtype):
    if x is None:
      return None
    x = jnp.broadcast_to(as4(x), (as4(x).shape[0], n1) + x.shape[-2:]).astype(dtype)
    x = jnp.broadcast_to(x, x.shape[:2] + (t, s))
    return flash_core.pad_axis(flash_core.pad_axis(x, 2, tp), 3, sp)

  return dense(bias, jnp.float32), dense(mask, jnp.int8)


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
              sinks=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, backend='interpret'):
  """The Triton kernels; arguments as `attention_blockwise.attention`, and `backend`: 'triton'
  (lowers for cuda/rocm only) or 'interpret' (any platform).

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  # Triton takes power-of-two tiles only: a short sequence gets the next power of two, and so does
  # the head dim.
  cfg, q, k, v = host.tiled(query, key, value, scale=scale, is_causal=is_causal, window=window,
                            softcap=softcap, block_q=block_q, block_k=block_k,
                            fit_len=pl.next_power_of_2, fit_width=pl.next_power_of_2)
  t, s = cfg.q_len, cfg.kv_len
  tp, sp = q.shape[2], k.shape[2]
  extra = host.per_head(alibi_slopes, sinks)
  extra['bias'], extra['mask'] = _dense_inputs(bias, mask, t, s, tp, sp)
  pad = flash_core.pad_axis
  extra['q_seg'] = None if q_segment_ids is None else pad(q_segment_ids.astype(jnp.int32), 1, tp)
  extra['kv_seg'] = None if kv_segment_ids is None else pad(
      kv_segment_ids.astype(jnp.int32), 1, sp)
  return host.untiled(_flash((cfg, backend), q, k, v, extra), query)  # [B, T, N, H]
