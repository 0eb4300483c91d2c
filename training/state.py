"""The training state: model, optimiser and schedule, built (and sharded) from a config."""

import sys

from etils import epath
import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import optax
import orbax.checkpoint as ocp

from layers import options
from layers import sharding
import models
from training import checkpointing

# Floating dtypes the forward/backward passes may run in (float16 is left out: its gradients
# underflow without loss scaling, which the step does not do).
COMPUTE_DTYPES = ('float32', 'bfloat16')
# train.schedule: what follows the warmup (make_schedule).
SCHEDULES = ('cosine', 'linear', 'constant')


def make_schedule(t):
  """Linear warmup to `learning_rate` over `warmup_steps`, then `schedule` (optax)."""
  decay_steps = t.steps - t.warmup_steps
  after = {
      'cosine': optax.cosine_decay_schedule(t.learning_rate, decay_steps),
      'linear': optax.linear_schedule(t.learning_rate, 0.0, decay_steps),
      'constant': optax.constant_schedule(t.learning_rate),
  }[t.schedule]
  if t.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps)
  return optax.join_schedules([warmup, after], [t.warmup_steps])


def make_optimizer(t):
  """AdamW with the schedule, after optional global-norm clipping."""
  chain = [optax.clip_by_global_norm(t.grad_clip_norm)] if t.grad_clip_norm > 0 else []
  chain.append(optax.adamw(make_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))
  return optax.chain(*chain)


def model_vocab_size(config, tokenizer_size):
  """V, the model's vocabulary: `model.vocab_size`, or the tokenizer's `tokenizer_size` when that
  is 0. Every place that builds or counts a model from a tokenizer (train.py, eval.py, the loop,
  tools.accounting, tools.aot) takes V from here.

  Raises:
    ConfigError: `model.vocab_size` > 0 is smaller than the tokenizer's vocabulary.
  """
  size = config.model.get('vocab_size', 0) or 0
  if not size:
    return tokenizer_size
  if size < tokenizer_size:
    raise options.ConfigError(f'model.vocab_size={size} must be 0 (the tokenizer\'s) or >= the '
                              f'tokenizer\'s {tokenizer_size} tokens')
  return size


def _builder(config, vocab_size, special_ids):
  """A function that builds the config's model with its seed's initial parameters."""
  return lambda: models.build(config.model, vocab_size, config.data.max_length,
                              rngs=nnx.Rngs(params=config.train.seed), special_ids=special_ids)


def create_state(config, vocab_size, mesh=None, *, special_ids=None):
  """Builds the model and optimiser; returns (graphdef, optimizer, state pytree).

  With a `mesh` (layers.sharding.make_mesh), the state is placed on it: parameters and buffers by
  their logical axis names under `config.mesh.rules`, the optimiser state like its parameters.

  `state['params']` are the trained `nnx.Param`s; `state['buffers']` every other model variable
  (e.g. the Performer's random features: checkpointed, not optimised; often empty). Rebuild the
  model with `nnx.merge(graphdef, *model_variables(state))`.
  """
  build = _builder(config, vocab_size, special_ids)
  tx = make_optimizer(config.train)
  if mesh is None:
    graphdef, params, buffers = nnx.split(build(), nnx.Param, ...)
    opt_state = tx.init(params)
  else:
    # Initialised inside jit straight into their shardings: each device computes only its shard,
    # so a model that fits the mesh but not one device can be built (FSDP).
    graphdef, params, buffers = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    shardings = state_shardings(config, mesh, tx, params, buffers)
    params, buffers = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[1:],
                              out_shardings=(shardings['params'], shardings['buffers']))()
    opt_state = jax.jit(tx.init, out_shardings=shardings['opt_state'])(params)
    replicated = shardings['step']
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'buffers': buffers,
           'opt_state': opt_state, 'skipped': jnp.zeros((), jnp.int32)}
  if mesh is not None:  # from the host: no device holds anything placed elsewhere afterwards
    state.update(jax.device_put({'step': np.zeros((), np.int32), 'skipped': np.zeros((), np.int32)},
                                replicated))
  return graphdef, tx, state


def state_shardings(config, mesh, tx, params, buffers):
  """The `NamedSharding` of every leaf of a training state on `mesh`: parameters and buffers by
  their logical axis names under `config.mesh.rules`, each optimiser moment where its parameter
  lives, counters replicated. `params`/`buffers` may be abstract (`nnx.eval_shape`)."""
  rules = sharding.rules_of(config.get('mesh', {}))
  param_sharding, buffer_sharding = (
      sharding.named(sharding.param_specs(v, mesh, rules), mesh) for v in (params, buffers))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  opt_sharding = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params),
                                       param_sharding, transform_non_params=lambda _: replicated)
  return {'step': replicated, 'params': param_sharding, 'buffers': buffer_sharding,
          'opt_state': opt_sharding, 'skipped': replicated}


def abstract_state(config, vocab_size, mesh, *, special_ids=None):
  """`create_state` without computing or placing anything: (graphdef, optimizer, state of
  `jax.ShapeDtypeStruct`s carrying their shardings on `mesh`), for ahead-of-time compilation on
  devices this host does not have (training.aot)."""
  build = _builder(config, vocab_size, special_ids)
  tx = make_optimizer(config.train)
  graphdef, params, buffers = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
  shapes = {'step': jax.ShapeDtypeStruct((), jnp.int32), 'params': params, 'buffers': buffers,
            'opt_state': jax.eval_shape(tx.init, params),
            'skipped': jax.ShapeDtypeStruct((), jnp.int32)}
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                       state_shardings(config, mesh, tx, params, buffers))
  return graphdef, tx, state


def model_variables(state):
  """(params, buffers) of a training state: `nnx.merge(graphdef, *model_variables(state))`."""
  return state['params'], state['buffers']


def merge(graphdef, variables):
  """The model from `variables`: one `nnx.State` or a tuple of them (`model_variables`)."""
  return nnx.merge(graphdef, *(variables if isinstance(variables, tuple) else (variables,)))


def redraw_features(graphdef, state, step):
  """The state with every layer's random features redrawn as due at `step` (host-side).

  A layer with `redraw_every` = R > 0 (the Performer with `model.performer_redraw` = R) gets draw
  number step // R when R divides `step`; the draws are functions of (layer seed, draw number),
  so resuming from a checkpoint redraws exactly as an uninterrupted run. Returns `state` itself
  when nothing is due.
  """
  model = nnx.merge(graphdef, *model_variables(state))
  due = [m for _, m in nnx.iter_modules(model)
         if getattr(m, 'redraw_every', 0) > 0 and step % m.redraw_every == 0]
  if not due:
    return state
  for module in due:
    module.redraw(step // module.redraw_every)
  return {**state, 'buffers': nnx.split(model, nnx.Param, ...)[2]}


def cast_params(params, dtype):
  """Floating parameters cast to the compute dtype (a no-op for float32): mixed precision."""
  if dtype == 'float32':
    return params
  return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                      params)




class InitFromError(checkpointing.RunFailed):
  """`train.init_from` names no usable run; the message is one line
  (train.py prints it, exits 1)."""


class _Absent(Exception):
  """A parameter of the config is not in a checkpoint's metadata (damage, or another model)."""


def _restore_params(mngr, state, step, want, source):
  """The parameters (and buffers) of checkpoint `step`, checked against `want` {name: shape}."""
  saved = checkpointing.saved_shapes(mngr, step)
  for name in sorted(want):
    if saved.get(name) != want[name]:
      got = 'absent' if name not in saved else f'shape {saved[name]}'
      message = (f'train.init_from={source!r}: parameter {name} is {got} in its checkpoint step '
                 f'{step} but {want[name]} in this config; the model must match the source run')
      raise (_Absent if name not in saved else InitFromError)(message)
  target = {'params': state['params']}
  if jax.tree.leaves(state['buffers']) and any(k.startswith('buffers/') for k in saved):
    target['buffers'] = state['buffers']
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  return mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
          abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
          partial_restore=True)))['state']


def init_from(state, source):
  """`state` with the parameters (and buffers) of the newest checkpoint of another run's workdir.

  For fine-tuning (e.g. a longer context): the step stays 0 and the optimiser state stays fresh
  (Adam's moments are zeros whatever the parameters), so the schedule starts over. Only the
  parameters and buffers are read (the source may have had another optimiser or step count).

  Args:
    state: a fresh training state (`create_state`) of the config being started.
    source: the source run's workdir (local or gs://), holding `checkpoints/<step>/`.

  Returns:
    (the state with the source's parameters, the source's checkpoint step).

  Raises:
    InitFromError: the directory does not exist, holds no checkpoint, or a parameter's shape
      differs from this config's (the first such parameter is named).
  """
  root = epath.Path(source)
  if not root.is_dir():
    raise InitFromError(f'train.init_from={source!r} is not a directory (the workdir of the run '
                        'to start from)')
  ckpt = root / 'checkpoints'
  saved_steps = sorted(int(p.name) for p in (ckpt.iterdir() if ckpt.is_dir() else ())
                       if p.name.isdigit())
  if not saved_steps:
    raise InitFromError(f'train.init_from={source!r} holds no checkpoint ({ckpt}/<step> '
                        'missing): train that run first')
  mngr = ocp.CheckpointManager(ckpt, options=ocp.CheckpointManagerOptions(read_only=True))
  want = {checkpointing._plain_path(p): tuple(np.shape(leaf))
          for p, leaf in jax.tree_util.tree_flatten_with_path(
              {'params': state['params']})[0]}
  unreadable, absent = [], None
  for step in reversed(saved_steps):  # the newest readable one, as train.py and eval.py resume
    try:
      restored = _restore_params(mngr, state, step, want, source)
    except InitFromError:
      raise  # a parameter of another shape: the source is another model
    except _Absent as e:
      # Damaged metadata reads as a partial tree: an older step may be whole. If none is, the
      # source lacks the parameter (another model) and the newest step's message says so.
      absent = absent or str(e)
      unreadable.append(f'{step} (parameters missing from its metadata)')
    except Exception as e:  # noqa: BLE001
      unreadable.append(f'{step} ({checkpointing.error_reason(e)})')
    else:
      break
  else:
    mngr.close()
    raise InitFromError(f'train.init_from={source!r}: no checkpoint can give this config its '
                        f'parameters (steps {"; ".join(unreadable)})' +
                        (f'; the newest: {absent.split(": ", 1)[1]}' if absent else ''))
  if unreadable:
    print(f'train: init_from {source}: checkpoint step{"s" if len(unreadable) > 1 else ""} '
          f'{"; ".join(unreadable)} unreadable; using step {step}', file=sys.stderr)
  mngr.close()
  return {**state, **restored}, step
