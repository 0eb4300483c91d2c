"""Dropless token choice under expert parallelism: shard_map, ragged all-to-all, grouped matmul.

GSPMD cannot partition a ragged matmul by expert (it gathers), so with `mesh.expert` > 1 the
dropless path runs per device under `jax.shard_map`, as MaxText's `sparse_matmul` does:

  1. each device sorts its own tokens' assignments by expert (the experts of one device are
     contiguous, so each destination's share is one contiguous run);
  2. a ragged all-to-all over the expert axes sends each run to the device holding its experts,
     into a buffer of the worst case (every assignment of the expert group on one device:
     P · tokens · min(k, E/P) rows), so nothing is ever dropped; or, with a buffer factor f > 0
     (MaxText's `ragged_buffer_factor`), of f times the balanced load (tokens · k rows), the
     assignments past it dropped in arrival order (sender by sender, each sender's by expert);
  3. the device sorts what it received by its local expert and runs its experts' FFN as grouped
     matmuls over the rows it received (megablox on TPU, `ragged_dot` elsewhere);
  4. the results go back by the reverse ragged all-to-all, and each token sums its k outputs.

`jax.lax.ragged_all_to_all` runs on TPU; XLA:CPU has no such op ("not supported by XLA:CPU"), so
any other platform moves the same runs through a plain all-to-all of a static buffer (each device
pair a slot of the worst-case run) and scatters them where the ragged op would put them.
The experts' weights enter split over the expert axes only (each device gathers its experts'
fsdp/tensor shards, as FSDP gathers a dense layer's).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm
from jax.sharding import PartitionSpec as P

from layers import sharding

# megablox's row tile; the rows are padded to a multiple of it.
TILE = 128


def _tiling(m, k, n):
  """Megablox's (rows, contraction, output) tiles for any of its calls, backward ones included:
  128 where it divides, else the whole dimension (Mosaic's blocks are 128-multiples or whole)."""
  whole_or_128 = lambda d: TILE if d % TILE == 0 else d  # noqa: E731
  return min(TILE, m), whole_or_128(k), whole_or_128(n)


def grouped_matmul(lhs, rhs, group_sizes):
  """Rows `[M, D]` sorted by group times each group's `rhs` `[G, D, F]` -> `[M, F]`; rows past
  sum(group_sizes) are 0. Megablox's kernel when lowered for TPU, `jax.lax.ragged_dot` elsewhere
  (chosen by the lowering platform, as `layers.attention_pallas`)."""

  def tpu(a, w, sizes):
    m = a.shape[0]
    padded = jnp.pad(a, ((0, -m % TILE), (0, 0)))  # gmm needs whole row tiles
    out = megablox_gmm(padded, w, sizes, preferred_element_type=a.dtype, tiling=_tiling)[:m]
    # The kernel leaves rows past the last group unwritten: zero them as ragged_dot does.
    return jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], out, 0)

  return lax.platform_dependent(lhs, rhs, group_sizes, tpu=tpu,
                                default=lambda a, w, sizes: lax.ragged_dot(a, w, sizes))


def _axes(dim):
  """The mesh axes of one entry of a PartitionSpec, as a tuple."""
  return () if dim is None else (dim,) if isinstance(dim, str) else tuple(dim)


def _token_axes(tokens):
  """The mesh axes a PartitionSpec `tokens` splits the tokens over, in order."""
  return tuple(a for dim in tokens for a in _axes(dim))


def layout(mesh, rules, x_shape, num_experts):
  """The mesh axes of the tokens `[B, T, D]` and of the experts, or None where this path does
  not apply (no expert axis splits the experts, or it does not also split the tokens: then every
  device of the expert axis holds the same tokens, and GSPMD's ragged_dot stands)."""
  tokens = sharding.spec(('batch', 'length', None), x_shape, mesh, rules)
  experts = sharding.spec(('expert',), (num_experts,), mesh, rules)[0]
  if not _axes(experts) or not set(_axes(experts)) <= set(_token_axes(tokens)):
    return None
  return tokens, _axes(experts)


def _exclusive_cumsum(a, axis):
  return jnp.cumsum(a, axis) - a


def _plans(routed, kept, me):
  """The ragged all-to-all arguments (input offsets, send sizes, output offsets, receive sizes)
  there and back, from `[P, P]` row counts sender i -> receiver j: `routed` (where sender i's
  runs start in its sorted rows) and `kept` (each run's prefix that fits the receiver's buffer);
  `me` this device."""
  there = (_exclusive_cumsum(routed[me], 0), kept[me],
           _exclusive_cumsum(kept, 0)[me], kept[:, me])
  back = (_exclusive_cumsum(kept[:, me], 0), kept[:, me],
          _exclusive_cumsum(routed, 1)[:, me], kept[me])
  return there, back


def kept_counts(counts, buffer):
  """`counts` `[sender, receiver, local expert]` clipped so that each receiver takes at most
  `buffer` rows, in arrival order (sender by sender, each sender's rows by expert): the rows of
  one sender to one receiver that are kept are a prefix of its run."""
  p, _, local = counts.shape
  arrivals = jnp.swapaxes(counts, 0, 1).reshape(p, p * local)  # [receiver, (sender, expert)]
  room = jnp.maximum(buffer - _exclusive_cumsum(arrivals, 1), 0)
  return jnp.swapaxes(jnp.minimum(arrivals, room).reshape(p, p, local), 0, 1)


def static_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, cap):
  """`jax.lax.ragged_all_to_all`'s result through a plain all-to-all: each run (at most `cap`
  rows) travels in a slot of `cap` rows and is scattered where the ragged op would write it."""
  r = jnp.arange(cap)
  rows = jnp.minimum(input_offsets[:, None] + r, operand.shape[0] - 1)  # [P, cap]
  runs = jnp.where((r < send_sizes[:, None])[..., None], operand[rows], 0)  # [P, cap, D]
  runs = lax.all_to_all(runs, axis_name, 0, 0, tiled=True)  # runs[j]: sender j's run for me
  offsets = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where j writes mine
  dest = jnp.where(r < recv_sizes[:, None], offsets[:, None] + r, output.shape[0])  # [P, cap]
  return output.at[dest.reshape(-1)].set(runs.reshape(-1, operand.shape[1]), mode='drop')


def _exchange(operand, rows, plan, *, axes, cap):
  """`operand`'s runs to their devices, into a `[rows, D]` buffer, by the platform's collective."""
  output = jnp.zeros((rows, operand.shape[1]), operand.dtype)
  ragged = functools.partial(lax.ragged_all_to_all, axis_name=axes)
  static = functools.partial(static_all_to_all, axis_name=axes, cap=cap)
  return lax.platform_dependent(operand, output, *plan, tpu=ragged, default=static)


def buffer_rows(tokens, k, local, p, buffer_factor):
  """The rows one device can receive: the worst case P · tokens · min(k, E/P) (nothing dropped)
  for `buffer_factor` 0, else ceil(f · tokens · k) (f times the balanced load), at most that."""
  worst = p * tokens * min(k, local)
  return worst if not buffer_factor else min(worst, math.ceil(buffer_factor * tokens * k))


def _local(x, top_i, weights, params, *, ffn, axes, split, num_experts, buffer_factor):
  """One device's share (inside shard_map): `x` `[B, T, D]`, `top_i`/`weights` `[B, T, k]` its
  tokens, `params` its experts' weights `[E/P, ...]`; returns `[B, T, D]` and the assignments
  kept over the whole mesh."""
  b, t, d = x.shape
  k = top_i.shape[-1]
  local = params['wi'].shape[0]
  p = num_experts // local
  flat = top_i.reshape(-1)  # [M = B·T·k]
  order = jnp.argsort(flat, stable=True)  # [M] by expert, so by destination
  rows = x.reshape(-1, d)[order // k]  # [M, D]
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E]
  counts = lax.all_gather(sizes, axes).reshape(p, p, local)  # [sender, receiver, local expert]
  me = lax.axis_index(axes)
  buffer = buffer_rows(b * t, k, local, p, buffer_factor)
  routed = jnp.sum(counts, -1)  # [P, P] rows sender i routes to receiver j
  counts = kept_counts(counts, buffer)  # those that fit; all of them at the worst-case buffer
  kept = jnp.sum(counts, -1)
  there, back = _plans(routed, kept, me)
  cap = b * t * min(k, local)  # the most rows one device can send to one other
  got = _exchange(rows, buffer, there, axes=axes, cap=cap)  # [buffer, D] by sender, then expert
  mine = counts[:, me]  # [P, E/P] rows from each sender for each local expert
  expert = jnp.repeat(jnp.append(jnp.tile(jnp.arange(local), p), local),
                      jnp.append(mine.reshape(-1), buffer - jnp.sum(mine)),
                      total_repeat_length=buffer)  # [buffer] local expert of each row; pad last
  by_expert = jnp.argsort(expert, stable=True)
  out = ffn(got[by_expert], jnp.sum(mine, 0).astype(jnp.int32), params)  # [buffer, D]
  out = jnp.zeros_like(out).at[by_expert].set(out)  # back in arrival order
  out = _exchange(out, flat.shape[0], back, axes=axes, cap=cap)  # [M, D] sorted by expert
  out = jnp.zeros_like(out).at[order].set(out).reshape(b, t, k, d)  # in token order
  y = jnp.einsum('BTKD,BTK->BTD', out, weights.astype(x.dtype))
  return y, lax.psum(jnp.sum(kept[me]), split)  # over the axes that split the tokens


def dropless(x, top_i, weights, params, ffn, num_experts, buffer_factor=0.0):
  """Dropless token choice on the mesh in context, or None where `layout` says it does not apply.

  Args:
    x: `[B, T, D]` tokens.
    top_i, weights: `[B, T, k]` each token's experts and combine weights.
    params: {'wi', 'wo', optionally 'up'}: the stacked experts' weights `[E, D, F]`/`[E, F, D]`.
    ffn: `ffn(rows [M, D], group_sizes [G], params) -> [M, D]`, the experts on rows sorted by
      expert with `grouped_matmul`.
    num_experts: E.
    buffer_factor: 0 for the worst-case receive buffer (nothing dropped), else f > 0: f times
      the balanced load, overflow dropped (`buffer_rows`).

  Returns:
    (`[B, T, D]`, the number of assignments kept), or None.
  """
  mesh = sharding.active_mesh()
  if mesh is None or mesh.size == 1:
    return None
  found = layout(mesh, sharding.active_rules(), x.shape, num_experts)
  if found is None:
    return None
  tokens, axes = found
  expert_spec = jax.tree.map(lambda w: P(axes, *(None,) * (w.ndim - 1)), params)
  per_device = functools.partial(_local, ffn=ffn, axes=axes, split=_token_axes(tokens),
                                 num_experts=num_experts, buffer_factor=buffer_factor)
  # check_vma off: megablox's pallas_call carries no varying-axes annotation for its outputs.
  return jax.shard_map(per_device, mesh=mesh, in_specs=(tokens, tokens, tokens, expert_spec),
                       out_specs=(tokens, P()), check_vma=False)(x, top_i, weights, params)
