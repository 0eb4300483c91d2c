"""Fused kernels on a mesh: a Pallas (Mosaic, Triton) or cuDNN call runs per device under shard_map.

XLA's partitioner (GSPMD) cannot split a custom call: on a mesh of more than one device a Mosaic
kernel fails to compile ("Mosaic kernels cannot be automatically partitioned") and a Triton or cuDNN
call would be gathered onto every device. `per_device(kernel)` wraps such a kernel in
`jax.shard_map` over the mesh in context (`jax.set_mesh`, or `layers.sharding.use_rules`), with the
specs spelled out from the logical-axis rules of `layers.sharding` (as MaxText wraps splash
attention):

  batch   split as the rules split 'batch' (default data x fsdp x expert), where the axes divide
          B;
  heads   split as the rules split 'heads' (default tensor), where they divide N. Key/value heads
          take the same axes. With fewer KV heads than the heads' shards (MQA, GQA with K < tensor)
          the KV heads are *repeated* to the shard count before the call (each shard then holds
          the one KV head its query group reads; the gradient of the repeat sums the copies back).
          Where neither K divides the shard count nor the count divides K, or N does not divide,
          heads stay whole on every device (correct, with the work repeated);
  length  never split: each device holds the whole sequence. A `sequence` axis > 1 is context
          parallelism, which `implementation='ring'` provides; `training.validation` refuses
          `pallas` / `cudnn` with `mesh.sequence > 1` in one line.

ALiBi slopes and sink logits are split like the heads, segment ids like the batch, and a dense bias
or mask along whichever of its batch and head dimensions is full-sized. Outside a mesh, or on one
device, the kernel is called unchanged.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from layers import sharding


def mesh_in_context():
  """The mesh the kernels run on: `jax.set_mesh`'s, else `sharding.use_rules`'s; None if there is
  none or it has one device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = sharding.active_mesh()
  if mesh is None or math.prod(mesh.shape.values()) == 1:
    return None
  return mesh


def _axes_size(mesh, axes):
  if axes is None:
    return 1
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def layout(mesh, rules, batch, heads, kv_heads):
  """The mesh axes of the batch and of the heads, and how often each KV head is repeated.

  Args:
    mesh: the mesh in context.
    rules: logical-axis rules (`layers.sharding`).
    batch, heads, kv_heads: B, N and K.

  Returns:
    (batch axes or None, head axes or None, repeats): the KV heads are repeated `repeats` times
    (1: not at all) so that every head shard holds whole query groups and their KV head.
  """
  # One spec for both: a mesh axis the rules give to the batch and the heads is used once.
  batch_axes, _, head_axes = sharding.spec(('batch', None, 'heads'), (batch, 1, heads), mesh,
                                           rules)
  shards = _axes_size(mesh, head_axes)
  if shards == 1 or kv_heads % shards == 0:
    return batch_axes, head_axes, 1
  if shards % kv_heads == 0:
    return batch_axes, head_axes, shards // kv_heads
  return batch_axes, None, 1


def per_device(kernel):
  """`kernel` (an entry of `layers.attention.IMPLEMENTATIONS`) run per device on the mesh in
  context; its arguments and result are unchanged (see the module docstring for the layout)."""

  @functools.wraps(kernel)
  def call(query, key, value, bias=None, mask=None, *, alibi_slopes=None, q_segment_ids=None,
           kv_segment_ids=None, sinks=None, **kwargs):
    if sinks is not None:
      kwargs['sinks'] = sinks  # only when set: a kernel without sinks takes no such argument
    mesh = mesh_in_context()
    if mesh is None:
      return kernel(query, key, value, bias, mask, alibi_slopes=alibi_slopes,
                    q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **kwargs)
    b, _, n, _ = query.shape
    batch_axes, head_axes, repeats = layout(mesh, sharding.active_rules(), b, n, key.shape[2])
    if repeats > 1:
      key = jnp.repeat(key, repeats, axis=2)  # [B, S, K*r, H]: shard i holds KV head i // r
      value = jnp.repeat(value, repeats, axis=2)
    x = P(batch_axes, None, head_axes, None)  # q, k, v and the output [B, T|S, N|K, H]

    def dense_spec(a):  # a `[B|1, N|1, T, S]` bias/mask: split the dims that are full-sized
      return P(batch_axes if a.shape[0] == b else None, head_axes if a.shape[1] == n else None)

    as_4d = lambda a: None if a is None else a.reshape((1,) * (4 - a.ndim) + a.shape)  # noqa: E731
    bias, mask = as_4d(bias), as_4d(mask)
    args = {'bias': bias, 'mask': mask, 'alibi_slopes': alibi_slopes,
            'q_segment_ids': q_segment_ids, 'kv_segment_ids': kv_segment_ids,
            'sinks': kwargs.pop('sinks', None)}
    args = {k: v for k, v in args.items() if v is not None}
    specs = {'alibi_slopes': P(head_axes), 'sinks': P(head_axes),
             'q_segment_ids': P(batch_axes, None),
             'kv_segment_ids': P(batch_axes, None)}
    arg_specs = {k: dense_spec(v) if k in ('bias', 'mask') else specs[k] for k, v in args.items()}

    def local(q, k, v, extra):
      extra = dict(extra)
      return kernel(q, k, v, extra.pop('bias', None), extra.pop('mask', None), **extra, **kwargs)

    # Under explicit mesh axes the arrays' types carry their shardings: move them to the specs
    # first, and the output back to the query's own sharding after.
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
    out_spec = jax.typeof(query).sharding.spec if explicit else None
    if explicit:
      query, key, value = (jax.sharding.reshard(a, x) for a in (query, key, value))
      args = {k: jax.sharding.reshard(v, arg_specs[k]) for k, v in args.items()}
    # check_vma off: a pallas_call carries no varying-axes annotation for its outputs.
    out = jax.shard_map(local, mesh=mesh, in_specs=(x, x, x, arg_specs), out_specs=x,
                        check_vma=False)(query, key, value, args)
    return jax.sharding.reshard(out, out_spec) if explicit else out

  return call
