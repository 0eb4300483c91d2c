"""FlashAttention-2 as Pallas kernels (forward, dQ, dK/dV): Triton on GPU, Mosaic on TPU.

The kernel is chosen by the platform the program is lowered for (`lax.platform_dependent`), not by
the host that traces it: a program compiled on a CPU host for a pod holds the pod's kernel.
cuda/rocm: the Triton kernels of this file; tpu: `layers.attention_pallas_tpu` (dense bias/mask
arrays go to the blockwise kernel there); any other platform: this file's kernels interpreted.

The visible-block bands are those of `layers.attention_blockwise`; the tile logits (visibility from
`layers.masks`), the online softmax, its finalize, dS and the custom VJP are `layers.flash_core`'s,
evaluated on each tile. One program handles one (batch, head, block) tile; loops over the other
sequence run inside the kernel over the band only.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from layers import attention_blockwise as blockwise
from layers import attention_pallas_tpu
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
      jnp.dot(q, k.T, preferred_element_type=jnp.float32),  # [bq, bk]
      i * cfg.block_q + lax.broadcasted_iota(jnp.int32, (bq, 1), 0),  # [bq, 1]
      j * cfg.block_k + lax.broadcasted_iota(jnp.int32, (1, bk), 1),  # [1, bk]
      scale=cfg.scale, is_causal=cfg.is_causal, window=cfg.window,
      kv_len=cfg.kv_len,  # keys past S pad the last tile
      bias=bias, slope=slope, q_seg=None if q_seg is None else q_seg[:, None],
      k_seg=None if kv_seg is None else kv_seg[None, :], mask=None if mask is None else mask != 0,
      softcap=cfg.softcap)


def _unpack(refs, flags):
  """Splits the kernel's refs into named optional inputs (absent ones are None) and the rest."""
  refs = list(refs)
  named = {}
  for name in _NAMES:
    named[name] = refs.pop(0) if flags[name] else None
  return named, refs


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, cfg, flags, num_k_blocks):
  extra, (o_ref, lse_ref) = _unpack(refs, flags)
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

  lo, hi = blockwise.key_block_band(i, cfg, num_k_blocks)
  carry = lax.fori_loop(lo, hi, body, flash_core.init_carry((q.shape[0],), v_ref.shape[-1]))
  sink = None if extra['sinks'] is None else extra['sinks'][...]  # [1], this head's
  out, lse = flash_core.finalize(carry, sink)  # [bq, H], [bq]
  o_ref[...] = out.astype(o_ref.dtype)
  lse_ref[...] = lse


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, num_k_blocks):
  extra, (dq_ref,) = _unpack(refs, flags)
  i = pl.program_id(2)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
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
    p = flash_core.probabilities(s, lse)  # lse = +inf on empty rows: p = 0
    dp = jnp.dot(do, v_ref[cols, :].T, preferred_element_type=jnp.float32)
    ds = flash_core.ds(p, dp, delta, s, cfg.softcap)
    return dq + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)

  lo, hi = blockwise.key_block_band(i, cfg, num_k_blocks)
  dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (cfg.scale * dq).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, cfg, flags, num_q_blocks,
                groups, bias_per_head):
  """dK, dV of one key tile of kv head kk: sums over its G query heads and their query band."""
  extra, out_refs = _unpack(refs, flags)
  dk_ref, dv_ref = out_refs[:2]
  dbias_ref = out_refs[2] if flags['bias'] else None
  j = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]  # [bk, H]
  kv_seg = None if extra['kv_seg'] is None else extra['kv_seg'][...]
  bq = cfg.block_q
  if dbias_ref is not None:
    # Tiles outside the band get no visit; their bias gradient is zero.
    dbias_ref[...] = jnp.zeros(dbias_ref.shape, dbias_ref.dtype)
  lo, hi = blockwise.query_block_band(j, cfg, num_q_blocks)
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
      p = flash_core.probabilities(s, lse_ref[g, rows])  # [bq, bk]
      dv = dv + jnp.dot(p.astype(do.dtype).T, do, preferred_element_type=jnp.float32)
      dp = jnp.dot(do, v.T, preferred_element_type=jnp.float32)
      ds = flash_core.ds(p, dp, delta_ref[g, rows], s, cfg.softcap)
      if dbias_ref is not None:
        dbias_ref[g, rows, :] = ds
      dk = dk + jnp.dot(ds.astype(q.dtype).T, q, preferred_element_type=jnp.float32)
      return dk, dv

    dk, dv = lax.fori_loop(lo, hi, body, (dk, dv))
  dk_ref[...] = (cfg.scale * dk).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _call(kernel, grid, in_specs, out_specs, out_shape, name, backend):
  """backend 'triton' (GPU lowering) or 'interpret' (any platform, the CPU tests)."""
  params = None
  if backend == 'triton':
    from jax.experimental.pallas import triton as plgpu
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=backend == 'interpret',
                        compiler_params=params, name=name)


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


def _extra_args(extra):
  return [extra[name] for name in _NAMES if extra[name] is not None]


def _flags(extra):
  return {name: extra[name] is not None for name in _NAMES}


def _forward(static, q, k, v, extra):
  """q `[B, N, Tp, H]`, k/v `[B, K, Sp, H]` -> out `[B, N, Tp, H]` float32, lse `[B, N, Tp]`.

  static: (TileConfig, backend).
  """
  cfg, backend = static
  b, n, tp, h = q.shape
  kh, sp = k.shape[1], k.shape[2]
  g, bq = n // kh, cfg.block_q
  kv_spec = pl.BlockSpec((None, None, sp, h), lambda bb, nn, i: (bb, lax.div(nn, g), 0, 0))
  q_spec = pl.BlockSpec((None, None, bq, h), lambda bb, nn, i: (bb, nn, i, 0))
  kernel = functools.partial(_fwd_kernel, cfg=cfg, flags=_flags(extra),
                             num_k_blocks=sp // cfg.block_k)
  return _call(
      kernel, (b, n, tp // bq),
      [q_spec, kv_spec, kv_spec] + _extra_specs(extra, g, bq, cfg.block_k, True),
      [q_spec, pl.BlockSpec((None, None, bq), lambda bb, nn, i: (bb, nn, i))],
      [jax.ShapeDtypeStruct((b, n, tp, v.shape[-1]), jnp.float32),
       jax.ShapeDtypeStruct((b, n, tp), jnp.float32)], 'flash_forward', backend,
  )(q, k, v, *_extra_args(extra))


def _backward(static, args, out, lse, d_out):
  """The dQ and dK/dV kernels: cotangents of (q, k, v, extra), the bias's only in `extra`."""
  cfg, backend = static
  q, k, v, extra = args
  b, n, tp, h = q.shape
  kh, sp = k.shape[1], k.shape[2]
  g, bq, bk = n // kh, cfg.block_q, cfg.block_k
  delta = flash_core.backward_delta(out, d_out)  # [B, N, Tp]
  do = d_out.astype(q.dtype)
  flags = _flags(extra)

  q_spec = pl.BlockSpec((None, None, bq, h), lambda bb, nn, i: (bb, nn, i, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda bb, nn, i: (bb, nn, i))
  kv_spec = pl.BlockSpec((None, None, sp, h), lambda bb, nn, i: (bb, lax.div(nn, g), 0, 0))
  dq = _call(
      functools.partial(_dq_kernel, cfg=cfg, flags=flags, num_k_blocks=sp // bk),
      (b, n, tp // bq),
      [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec] + _extra_specs(extra, g, bq,
                                                                            cfg.block_k, True),
      q_spec, jax.ShapeDtypeStruct(q.shape, jnp.float32), 'flash_dq', backend,
  )(q, k, v, do, lse, delta, *_extra_args(extra))

  # The G query heads of kv head kk are the kk-th group of G consecutive heads.
  qg_spec = pl.BlockSpec((None, g, tp, h), lambda bb, kk, j: (bb, kk, 0, 0))
  rowg_spec = pl.BlockSpec((None, g, tp), lambda bb, kk, j: (bb, kk, 0))
  kt_spec = pl.BlockSpec((None, None, bk, h), lambda bb, kk, j: (bb, kk, j, 0))
  out_specs = [kt_spec, kt_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, jnp.float32),
               jax.ShapeDtypeStruct(v.shape, jnp.float32)]
  if flags['bias']:
    # ds of every (head, query, key): the bias is dense in T and S, so is its gradient.
    out_specs.append(pl.BlockSpec((None, g, tp, bk), lambda bb, kk, j: (bb, kk, 0, j)))
    out_shape.append(jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32))
  bias_per_head = extra['bias'] is not None and extra['bias'].shape[1] > 1
  if extra['mask'] is not None:
    bias_per_head = extra['mask'].shape[1] > 1
  if extra['bias'] is not None and extra['mask'] is not None:
    assert extra['bias'].shape[1] == extra['mask'].shape[1]
  res = _call(
      functools.partial(_dkv_kernel, cfg=cfg, flags=flags, num_q_blocks=tp // bq, groups=g,
                        bias_per_head=bias_per_head),
      (b, kh, sp // bk),
      [qg_spec, kt_spec, kt_spec, qg_spec, rowg_spec, rowg_spec] + _extra_specs(extra, g, bq,
                                                                                bk, False),
      out_specs, out_shape, 'flash_dkv', backend,
  )(q, k, v, do, lse, delta, *_extra_args(extra))
  dk, dv = res[0], res[1]
  dbias = None
  if flags['bias']:
    b1, n1 = extra['bias'].shape[:2]
    dbias = res[2]
    dbias = dbias if b1 > 1 else dbias.sum(0, keepdims=True)
    dbias = dbias if n1 > 1 else dbias.sum(1, keepdims=True)
  d_extra = {name: None for name in extra}  # slopes and segment ids: no gradient
  d_extra['bias'] = dbias
  if flags['sinks']:
    d_extra['sinks'] = flash_core.sink_grad(extra['sinks'][:, None], lse, delta, (0, 2))  # [N]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_extra


_flash = flash_core.flash_vjp(_forward, _backward)  # _flash((cfg, backend), q, k, v, extra)


def gpu_attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
                  alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
                  sinks=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
                  backend='interpret'):
  """The Triton kernels; arguments as `attention_blockwise.attention`, and `backend`: 'triton'
  (lowers for cuda/rocm only) or 'interpret' (any platform).

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  b, t, n, h = query.shape
  s = key.shape[1]
  # Triton takes power-of-two tiles only: a short sequence gets the next power of two (its padded
  # keys are masked, its padded query rows dropped), and so does the head dim (zero features add
  # nothing to q·k; v's zero columns give output columns that are dropped).
  bq, bk = min(block_q, pl.next_power_of_2(t)), min(block_k, pl.next_power_of_2(s))
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  hp = pl.next_power_of_2(h)
  cfg = blockwise.TileConfig(float(scale), bool(is_causal),
                             None if window is None else tuple(window), t, s, bq, bk,
                             softcap=float(softcap or 0.0))
  pad_t = flash_core.pad_axis
  q = pad_t(pad_t(query, 1, tp), 3, hp).transpose(0, 2, 1, 3)  # [B, N, Tp, Hp]
  k = pad_t(pad_t(key, 1, sp), 3, hp).transpose(0, 2, 1, 3)  # [B, K, Sp, Hp]
  v = pad_t(pad_t(value, 1, sp), 3, hp).transpose(0, 2, 1, 3)  # [B, K, Sp, Hp]

  def dense_bt(x, dtype):
    # [b, N|1, Tp, Sp]: batch and head axes stay broadcast (index maps pick block 0), the sequence
    # axes are materialised so that every tile has the same static shape.
    if x is None:
      return None
    x = x.reshape((1,) * (4 - x.ndim) + x.shape).astype(dtype)
    x = jnp.broadcast_to(x, x.shape[:2] + (t, s))
    return pad_t(pad_t(x, 2, tp), 3, sp)

  n1 = max([1] + [x.reshape((1,) * (4 - x.ndim) + x.shape).shape[1]
                  for x in (bias, mask) if x is not None])
  widen = lambda x: None if x is None else jnp.broadcast_to(
      x.reshape((1,) * (4 - x.ndim) + x.shape),
      (x.reshape((1,) * (4 - x.ndim) + x.shape).shape[0], n1) + x.shape[-2:])
  extra = {
      'bias': dense_bt(widen(bias), jnp.float32),
      'mask': dense_bt(widen(mask), jnp.int8),  # int8: boolean refs do not lower everywhere
      'slopes': None if alibi_slopes is None else lax.stop_gradient(
          alibi_slopes.astype(jnp.float32)),
      'sinks': None if sinks is None else sinks.astype(jnp.float32),  # [N], differentiated
      'q_seg': None if q_segment_ids is None else pad_t(q_segment_ids.astype(jnp.int32), 1, tp),
      'kv_seg': None if kv_segment_ids is None else pad_t(kv_segment_ids.astype(jnp.int32), 1, sp),
  }
  out = _flash((cfg, backend), q, k, v, extra)  # [B, N, Tp, Hp]
  return out[:, :, :t, :h].transpose(0, 2, 1, 3).astype(query.dtype)


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
              sinks=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
  """Pallas FlashAttention-2 for the platform the program is lowered for; the arguments are those
  of `attention_blockwise.attention` (block_q/block_k: the Triton/interpreted kernel's tiles; the
  TPU kernel keeps its own multiples of 128).

  Every branch is traced; lowering keeps only the lowering platform's (the others never reach a
  compiler), so a CPU host can lower the pod's kernel, and the unit tests check that it does.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  kw = dict(scale=scale, is_causal=is_causal, window=window, softcap=softcap)

  def gpu(backend):
    return lambda x, y, z, o: gpu_attention(
        x, y, z, o['bias'], o['mask'], alibi_slopes=o['slopes'], q_segment_ids=o['q_seg'],
        kv_segment_ids=o['kv_seg'], sinks=o['sinks'], block_q=block_q, block_k=block_k,
        backend=backend, **kw)

  def tpu(x, y, z, o):
    if o['bias'] is not None or o['mask'] is not None:
      # The Mosaic kernel takes no dense [T, S] arrays; the blockwise kernel does, in O(T) memory.
      return blockwise.attention(x, y, z, o['bias'], o['mask'], alibi_slopes=o['slopes'],
                                 q_segment_ids=o['q_seg'], kv_segment_ids=o['kv_seg'],
                                 sinks=o['sinks'], **kw)
    return attention_pallas_tpu.attention(x, y, z, alibi_slopes=o['slopes'],
                                          q_segment_ids=o['q_seg'], kv_segment_ids=o['kv_seg'],
                                          sinks=o['sinks'], **kw)

  extra = {'bias': bias, 'mask': mask, 'slopes': alibi_slopes, 'q_seg': q_segment_ids,
           'kv_seg': kv_segment_ids, 'sinks': sinks}
  return lax.platform_dependent(query, key, value, extra, cuda=gpu('triton'), rocm=gpu('triton'),
                                tpu=tpu, default=gpu('interpret'))
