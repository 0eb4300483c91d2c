"""Cost estimates for jax's splash kernels, which pass none to their `pl.pallas_call`s.

Without one, XLA's cost analysis counts a Mosaic call as nothing: a program's FLOPs and bytes, and
the roofline estimate built on them (`training.roofline`), leave splash's attention out. jax's
module is used as it is, not copied: while `costed(costs)` is open, its module global `pl` is a
proxy whose `pallas_call` adds the estimate of the call it is asked for (forward, dQ or dK/dV, by
the kernel name splash gives it) when the call carries none, and `with_costs` opens that scope
around the kernel's forward and, through a `jax.custom_vjp`, around its backward too (traced when
the gradient is, after the forward has returned).

The estimates follow the Mosaic flash kernel's conventions (`attention_pallas_host.tile_cost`): per
computed (query block, key block) pair, 2·block_q·block_k·H FLOPs per matrix product (forward 2,
dQ 3, dK/dV 4), an exp per score (and a tanh under the soft cap), and the bytes of the tiles read
(plus the [N, T, H] arrays each call reads or writes once: exact for multi-head self-attention; with
GQA or a cross length the dK/dV call's once-arrays are counted at the query heads' size, as the
Mosaic kernel's estimate does, an overcount of about 2·(N - K)·S·H·itemsize a row);
the pairs are the non-empty blocks of splash's own block mask for that call (`MaskInfo.block_mask`,
the kernels skip the empty ones): the causal band, a window's band.
"""

import contextlib
import re
import threading

import jax
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask_info as mask_info_lib)

from layers import attention_pallas_host as host

# splash's kernel names (`splash_attention_kernel.get_kernel_name`):
# splash_{mha|mqa}_{fwd|dq|dkv}[_segmented]_{residuals|no_residuals}.
_NAME = re.compile(r'splash_m[hq]a_(fwd|dq|dkv)(_segmented)?_(no_)?residuals')
# By splash phase: the products counted (`attention_pallas_host.MATMULS`) and the [N, Tp, H]
# arrays read or written once (forward q and out; dQ q, dO, dQ; dK/dV q, dO, dK, dV).
PHASES = {'fwd': ('forward', 2), 'dq': ('dq', 3), 'dkv': ('dkv', 4)}
# Held while splash's `pl` is the proxy: one scope at a time (re-entrant for the thread holding it).
_LOCK = threading.RLock()


def visited_blocks(mask, block, phase):
  """How many (query block, key block) pairs of `block` x `block` the `phase` kernel computes for
  the MultiHeadMask `mask` [N, T, S], all heads: the non-zero entries of splash's block mask for
  that kernel (its MaskInfo, from splash's own cached `process_mask`), a mask shared by every head
  counted once per head."""
  if phase == 'dkv':
    info, _ = mask_info_lib.process_mask_dkv(mask, (block, block), downcast_smem_data=True,
                                             head_shards=1, q_seq_shards=1, shrink_grid=True)
  else:
    info, _ = mask_info_lib.process_mask(mask, (block, block), downcast_smem_data=True,
                                         head_shards=1, q_seq_shards=1)
  heads, per_mask = mask.shape[0], info.block_mask.shape[0]  # per_mask: 1 when all heads share it
  return int(np.count_nonzero(info.block_mask)) * (heads // per_mask)


def estimates(mask, block, *, kv_heads, head_dim, itemsize, softcap):
  """{phase: `pl.CostEstimate`} of one batch row's splash call over `mask` [N, Tp, Sp] in `block`
  tiles, for q [N, Tp, H] and k, v [K, Sp, H] of `itemsize` bytes (vmap scales it by the rows)."""
  n, tp, sp = mask.shape
  d = host.Dims(1, n, kv_heads, n // kv_heads, tp, sp, head_dim, tp // block, sp // block)
  return {phase: host.tile_cost(visited_blocks(mask, block, phase), (block, block), d, call,
                                itemsize, softcap=softcap, once=once, per_tile=2)
          for phase, (call, once) in PHASES.items()}


def phase_of(name):
  """'fwd', 'dq' or 'dkv' from a splash kernel name; a name it does not know is an error, not an
  uncounted call."""
  found = _NAME.fullmatch(name or '')
  if found is None:
    raise ValueError(f'splash pallas_call {name!r}: not a kernel name the cost estimates know '
                     f'({_NAME.pattern})')
  return found.group(1)


class _CostedPallas:
  """splash's `pl` (`jax.experimental.pallas`) for the thread that opened the scope, its
  `pallas_call` given `costs[phase]` where the call has no estimate; everything else, and every
  other thread's call, passes through unchanged."""

  def __init__(self, pl, costs):
    self._pl, self._costs, self._thread = pl, costs, threading.get_ident()

  def __getattr__(self, name):
    return getattr(self._pl, name)

  def pallas_call(self, *args, **kwargs):
    if threading.get_ident() == self._thread and kwargs.get('cost_estimate') is None:
      kwargs['cost_estimate'] = self._costs[phase_of(kwargs.get('name'))]
    return self._pl.pallas_call(*args, **kwargs)


@contextlib.contextmanager
def costed(costs):
  """splash's pallas_calls traced inside carry `costs` ({phase: CostEstimate}); its module is
  restored on the way out."""
  with _LOCK:
    previous = kernel_lib.pl
    real = previous._pl if isinstance(previous, _CostedPallas) else previous
    kernel_lib.pl = _CostedPallas(real, costs)
    try:
      yield
    finally:
      kernel_lib.pl = previous


def with_costs(fn, costs):
  """`fn(*args)` (splash's call) with its forward and its backward traced under `costed(costs)`.

  The backward of splash's own custom_vjp is traced when the gradient is, after `fn` has returned:
  the outer custom_vjp's `bwd` opens the scope again around `jax.vjp`'s pullback, so the dQ and
  dK/dV calls carry theirs too. `fn` must not close over traced arrays (it builds the kernel)."""

  @jax.custom_vjp
  def call(*args):
    with costed(costs):
      return fn(*args)

  def fwd(*args):
    with costed(costs):
      return jax.vjp(fn, *args)  # (out, pullback): the pullback is a pytree of the residuals

  def bwd(pullback, cotangent):
    with costed(costs):
      return pullback(cotangent)

  call.defvjp(fwd, bwd)
  return call
