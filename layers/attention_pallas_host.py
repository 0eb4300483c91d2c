"""What the Triton and Mosaic flash kernels' host sides share: tiles, padding, optional inputs."""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from layers import flash_core


def round_up(x, m):
  """The least multiple of m that is >= x."""
  return -(-x // m) * m


def tiled(query, key, value, *, scale, is_causal, window, softcap, block_q, block_k, fit_len,
          fit_width):
  """The tile settings and the heads-major, padded q, k, v of one Pallas call.

  Lengths are padded to whole tiles; padded keys are masked (k_pos < S) and padded query rows are
  dropped, and their zero cotangent adds nothing to dK/dV: results are exact. A padded head dim
  adds zero features, which add nothing to q·k; v's zero columns give output columns that
  `untiled` drops.

  Args:
    query: `[B, T, N, H]`; key, value: `[B, S, K, H]`.
    scale, is_causal, window, softcap: as in `flash_core.TileConfig`.
    block_q, block_k: the largest tiles.
    fit_len: a length -> the smallest tile that covers it (the platform's shape rule).
    fit_width: H -> the padded head dim.

  Returns:
    (`flash_core.TileConfig`, q `[B, N, Tp, Hp]`, k, v `[B, K, Sp, Hp]`).
  """
  t, h = query.shape[1], query.shape[3]
  s = key.shape[1]
  bq, bk = min(block_q, fit_len(t)), min(block_k, fit_len(s))
  tp, sp, hp = round_up(t, bq), round_up(s, bk), fit_width(h)
  cfg = flash_core.TileConfig(float(scale), bool(is_causal),
                              None if window is None else tuple(window), t, s, bq, bk,
                              softcap=float(softcap or 0.0))
  pad = flash_core.pad_axis
  heads_major = lambda x, length: pad(pad(x, 1, length), 3, hp).transpose(0, 2, 1, 3)
  return cfg, heads_major(query, tp), heads_major(key, sp), heads_major(value, sp)


def untiled(out, query):
  """The kernel's `[B, N, Tp, Hp]` output as the query's `[B, T, N, H]`, in its dtype."""
  t, h = query.shape[1], query.shape[3]
  return out[:, :, :t, :h].transpose(0, 2, 1, 3).astype(query.dtype)


def per_head(alibi_slopes, sinks):
  """The per-head inputs both kernels take, float32 `[N]` or None: ALiBi slopes (fixed, no
  gradient) and sink logits (differentiated)."""
  return {
      'slopes': None if alibi_slopes is None else lax.stop_gradient(
          alibi_slopes.astype(jnp.float32)),
      'sinks': None if sinks is None else sinks.astype(jnp.float32),
  }


def flags(extra, names):
  """Which of the optional inputs `names` (in the kernel's ref order) are given."""
  return {name: extra[name] is not None for name in names}


def present(extra, flags):
  """The given optional inputs, in the order of `flags` (the kernel's refs)."""
  return [extra[name] for name, given in flags.items() if given]


def unpack(refs, flags):
  """Inside a kernel: its refs split into the named optional inputs (absent ones None), in the
  order of `flags`, and the refs after them (outputs, scratch)."""
  refs = list(refs)
  return {name: refs.pop(0) if given else None for name, given in flags.items()}, refs


def call(kernel, grid, in_specs, out_specs, out_shape, name, *, params=None, interpret=False,
         scratch=(), cost=None):
  """`pl.pallas_call` of `kernel` over `grid`.

  `params` and `interpret` are the platform's: Triton's or Mosaic's compiler parameters, and
  False or its interpreter (True, or `pltpu.InterpretParams()`); `scratch`: buffers that persist
  along the grid's sequential axes (Mosaic's VMEM accumulators); `cost`: the call's
  `pl.CostEstimate` (`cost_estimate`), so that XLA's cost analysis of the program counts it.
  """
  spec = pl.GridSpec(grid=grid, in_specs=in_specs, out_specs=out_specs, scratch_shapes=scratch)
  return pl.pallas_call(kernel, grid_spec=spec, out_shape=out_shape, compiler_params=params,
                        interpret=interpret, name=name, cost_estimate=cost)


# [block_q, block_k] x H products per visited tile, by kernel call: the forward's QKᵀ and PV; the
# dQ pass recomputes QKᵀ, then dP = dO Vᵀ and dQ = dS K; the dK/dV pass recomputes QKᵀ and dP,
# then dV = Pᵀ dO and dK = dSᵀ Q.
MATMULS = {'forward': 2, 'dq': 3, 'dkv': 4}


def cost_estimate(cfg, d, call, itemsize, *, once, per_tile):
  """The `pl.CostEstimate` of one call of a flash kernel of `Dims` d.

  FLOPs: `MATMULS[call]` products of 2·block_q·block_k·H per visited tile (the band's tiles,
  `flash_core.visited_tiles`) of every batch row and query head; transcendentals: one exp per
  score, and a tanh with the soft cap; bytes: `once` arrays of `[B, N, Tp, H]` read or written
  once (q, dO, the outputs) and `per_tile` key-side tiles `[block, H]` read per visited tile.
  """
  tiles = flash_core.visited_tiles(cfg, d.nq, d.nk) * d.b * d.n
  return tile_cost(tiles, (cfg.block_q, cfg.block_k), d, call, itemsize, softcap=bool(cfg.softcap),
                   once=once, per_tile=per_tile)


def tile_cost(tiles, blocks, d, call, itemsize, *, softcap, once, per_tile):
  """The `pl.CostEstimate` of a call that computes `tiles` (query tile, key tile) pairs of `blocks`
  = (block_q, block_k), every batch row and query head together: `cost_estimate`'s conventions
  for a count of tiles made elsewhere (jax's splash kernels count theirs from their block mask)."""
  block_q, block_k = blocks
  pairs = tiles * block_q * block_k
  return pl.CostEstimate(
      flops=2 * MATMULS[call] * pairs * d.h,
      transcendentals=pairs * (2 if softcap else 1),
      bytes_accessed=itemsize * d.h * (once * d.b * d.n * d.tp + per_tile * tiles * block_k))


class Dims(NamedTuple):
  """The sizes of one call: q `[b, n, tp, h]`, k and v `[b, kh, sp, h]`, g = n / kh query heads per
  key/value head, nq x nk tiles."""
  b: int
  n: int
  kh: int
  g: int
  tp: int
  sp: int
  h: int
  nq: int
  nk: int


def dims(cfg, q, k):
  """`Dims` of heads-major q `[B, N, Tp, H]` and k `[B, K, Sp, H]` cut into `cfg`'s tiles."""
  b, n, tp, h = q.shape
  kh, sp = k.shape[1], k.shape[2]
  return Dims(b, n, kh, n // kh, tp, sp, h, tp // cfg.block_q, sp // cfg.block_k)


def backward_rows(extra, out, lse, d_out, dtype):
  """What both backward passes compute outside their kernels.

  Args:
    extra: the optional inputs; out `[B, N, Tp, H]` and lse `[B, N, Tp]`: the forward's;
    d_out: the output's cotangent; dtype: the inputs'.

  Returns:
    (delta `[B, N, Tp]`, dO in `dtype`, the cotangents of `extra`: the sinks' from the rows' lse and
    delta, None for the others, a bias's left to the caller's kernel).
  """
  delta = flash_core.backward_delta(out, d_out)  # [B, N, Tp]
  d_extra = {name: None for name in extra}  # slopes and segment ids: no gradient
  if extra.get('sinks') is not None:
    d_extra['sinks'] = flash_core.sink_grad(extra['sinks'][:, None], lse, delta, (0, 2))  # [N]
  return delta, d_out.astype(dtype), d_extra
