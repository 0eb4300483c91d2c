"""Logical axis names -> mesh axes: the one place where a model meets a device mesh.

Layers name the axes of their parameters and of a few key activations with logical names
(`LOGICAL_AXES`); they never name mesh axes. A rules table (`config.mesh.rules`, default
`DEFAULT_RULES`) maps each logical name to mesh axes of the mesh `data` x `fsdp` x `tensor` x
`sequence` x `expert` (`MESH_AXES`), as in MaxText and big_vision:

  batch    -> (data, fsdp, expert)   data and FSDP parallelism split the batch, and so does the
                                     expert axis outside the experts (as in MaxText)
  length   -> sequence       context parallelism splits the sequence (ring attention)
  embed    -> fsdp           FSDP shards every parameter along its model dimension
  heads, kv_heads, mlp, vocab -> tensor   Megatron-style tensor parallelism
  expert   -> expert         expert parallelism: each device holds E / mesh.expert experts
  head_dim, act_embed -> none (replicated)

Parameters carry their names as variable metadata (`partitioned`, read back by `param_specs`);
activations are annotated with `constrain`, a no-op unless a mesh and rules are active
(`use_rules`).
A dimension that a mesh axis does not divide is replicated rather than refused (e.g. MQA's single
KV head under tensor parallelism), so every config runs under every mesh.
"""

import contextlib
import math
import threading

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ('data', 'fsdp', 'tensor', 'sequence', 'expert')
LOGICAL_AXES = ('batch', 'length', 'embed', 'act_embed', 'heads', 'kv_heads', 'head_dim', 'mlp',
                'vocab', 'expert')
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp', 'expert')),
    ('length', 'sequence'),
    ('embed', 'fsdp'),
    ('act_embed', None),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('vocab', 'tensor'),
    ('expert', 'expert'),  # the stacked experts of layers.moe
)


def partitioned(init, *names):
  """`init` whose parameter carries the logical axis `names` (one per dimension; None = none).

  Kept as `logical_axes` metadata, not flax's `out_sharding`, which would shard eagerly at creation
  and need a mesh there: layers are built (tests, notebooks) with no mesh in sight.
  """
  return nnx.with_metadata(init, logical_axes=tuple(names))


def make_mesh(mesh_config, devices=None):
  """The `data` x `fsdp` x `tensor` x `sequence` x `expert` mesh of `config.mesh` over
  `devices` (default all).

  All sizes 1 is a one-device run on the first device, whatever the device count.

  Raises:
    ValueError: the axis sizes' product is not the device count (one line, naming the sizes).
  """
  devices = jax.devices() if devices is None else devices
  shape = tuple(int(mesh_config.get(a, 1)) for a in MESH_AXES)
  if math.prod(shape) == 1 and jax.process_count() > 1:
    raise ValueError(f'config.mesh sizes are all 1 (one device) but {jax.process_count()} '
                     f'processes run; set mesh.data/fsdp/tensor/sequence/expert to cover all '
                     f'{len(devices)} devices')
  if math.prod(shape) == 1:
    devices = devices[:1]
  if math.prod(shape) != len(devices):
    sizes = ', '.join(f'mesh.{a}={s}' for a, s in zip(MESH_AXES, shape))
    raise ValueError(f'{sizes}: their product {math.prod(shape)} must equal the device count '
                     f'{len(devices)}')
  # Auto axes: XLA's sharding propagation places what the annotations leave open (the GSPMD model
  # of MaxText/big_vision), rather than explicit-sharding types on every array.
  return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                       devices=devices)


def rules_of(mesh_config):
  """`DEFAULT_RULES` with `config.mesh.rules` overriding the names it lists (tuple of pairs)."""
  rules = mesh_config.get('rules', None) if hasattr(mesh_config, 'get') else None
  table = dict(DEFAULT_RULES)
  table.update((name, tuple(a) if isinstance(a, (list, tuple)) else a) for name, a in rules or ())
  return tuple(table.items())


def spec(names, shape, mesh, rules):
  """The `PartitionSpec` of an array of `shape` with logical axis `names` under `rules`.

  A mesh axis is used at most once per array (the first dimension that asks for it keeps it) and
  only where its size divides the dimension; every other dimension is replicated.
  """
  table = dict(rules)
  used, out = set(), []
  for name, dim in zip(names, shape):
    axes = table.get(name) if name is not None else None
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    keep = []
    for axis in axes:
      size = mesh.shape[axis]
      if axis in used or size == 1 or dim % (math.prod(mesh.shape[a] for a in keep) * size):
        continue
      keep.append(axis)
    used.update(keep)
    out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
  return P(*out)


def _names(variable):
  names = variable.get_metadata().get('logical_axes')
  return tuple(names) if names else (None,) * variable.value.ndim


def param_specs(state, mesh, rules):
  """`PartitionSpec`s for an `nnx.State` of variables (their logical names; unnamed: replicated)."""
  return jax.tree.map(
      lambda v: v.replace(spec(_names(v), v.value.shape, mesh, rules)), state,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def named(specs, mesh):
  """`PartitionSpec`s (any pytree) -> `NamedSharding`s on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


class _Active(threading.local):
  mesh = None
  rules = ()


_ACTIVE = _Active()


@contextlib.contextmanager
def use_rules(mesh, rules):
  """While active (tracing the train/eval step), `constrain` pins activations to `mesh`."""
  old = _ACTIVE.mesh, _ACTIVE.rules
  _ACTIVE.mesh, _ACTIVE.rules = mesh, tuple(rules)
  try:
    yield
  finally:
    _ACTIVE.mesh, _ACTIVE.rules = old


def active_mesh():
  """The mesh of the innermost `use_rules`, or None."""
  return _ACTIVE.mesh


def active_rules():
  """The rules of the innermost `use_rules`, or `DEFAULT_RULES` outside one."""
  return _ACTIVE.rules or DEFAULT_RULES


def constrain(x, names):
  """`x` with the sharding its logical axis `names` get under the active rules (no-op without)."""
  mesh = _ACTIVE.mesh
  if mesh is None or mesh.size == 1:
    return x
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(names, x.shape, mesh,
                                                                      _ACTIVE.rules)))
