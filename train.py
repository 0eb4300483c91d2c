"""Trains an attnlab model: `python train.py --config=configs/NAME.py --workdir=DIR`.

Resumes from the newest checkpoint in DIR (parameters, optimiser and data position), so a killed run
rerun with the same command continues with exactly the batches it would have seen.
"""

import contextlib
import ctypes
import functools
import importlib.metadata
import importlib.util
import json
import math
import os
import signal
import sys
import threading
import time

from absl import app
from absl import flags
from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
import tqdm

from tools import compare
from configs import default as default_config
from training import validation
from data import pipeline
from layers import block as block_lib
from layers import masks
from layers import sharding
import models

FLAGS = flags.FLAGS


def define_flags():
  """The CLI flags, defined only when run as a program (eval.py imports this module)."""
  config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and logs.')
  # Sweeps (tools/sweep.py): every cell of a configs/ablations/*.py grid in its own workdir.
  flags.DEFINE_string('sweep', None, 'A sweep file (configs/ablations/NAME.py[:ARG]); runs every '
                      'cell into --sweep_dir/<cell name> instead of training --config.')
  flags.DEFINE_string('sweep_dir', None, 'Directory of the sweep: one workdir per cell.')
  flags.DEFINE_bool('dry_run', False, 'With --sweep: print the train.py (and eval.py) command of '
                    'every cell and run nothing (for launching cells on a cluster).')
  flags.DEFINE_list('seeds', None, 'With --sweep: seeds to run (default: the sweep file\'s).')
  flags.DEFINE_integer('parallel', 1, 'With --sweep: cells run side by side, each on one thread.')
  flags.DEFINE_bool('sweep_eval', False, 'With --sweep: run the sweep file\'s eval.py flags on '
                    'each finished cell.')
  define_distributed_flags()
  define_host_malloc_flag()
  flags.DEFINE_integer('test_sigterm_after', None, 'Testing: this process sends itself SIGTERM '
                       'after that step, as a preemption notice that reaches one host only.')


def define_host_malloc_flag():
  flags.DEFINE_enum('host_malloc', 'auto', ['auto', 'on', 'off'], 'Tune glibc malloc before JAX '
                    'starts (`tune_host_malloc`): auto = when no GPU/TPU plugin is installed.')


def define_distributed_flags():
  """Multi-host flags of train.py and eval.py: the arguments of `jax.distributed.initialize`."""
  flags.DEFINE_string('coordinator_address', None, 'Multi-process: host:port of process 0 '
                      '(none of the three flags: auto-detected on TPU pods and SLURM, else one '
                      'process).')
  flags.DEFINE_integer('num_processes', None, 'Multi-process: the number of processes.')
  flags.DEFINE_integer('process_id', None, 'Multi-process: this process\'s index.')
  flags.DEFINE_bool('multihost', False, 'Join a multi-process run found by JAX\'s auto-detection '
                    '(TPU pod slices, SLURM, Open MPI) even if no cluster variable is seen.')


CLUSTER_ENV = ('SLURM_STEP_NUM_TASKS', 'TPU_WORKER_HOSTNAMES', 'MEGASCALE_COORDINATOR_ADDRESS',
               'OMPI_COMM_WORLD_SIZE')


def init_distributed(coordinator_address=None, num_processes=None, process_id=None,
                     multihost=False):
  """Joins a multi-process run before any other JAX call; returns the process count.

  Explicit arguments join that run (on CPU over gloo collectives, e.g. local processes on
  loopback); with none, a cluster JAX can detect (SLURM, Open MPI, GKE TPU variables in
  `CLUSTER_ENV`, or any with `multihost`, e.g. a Cloud TPU VM slice) is joined with
  auto-detection, and anything else is a single process.
  """
  explicit = any(v is not None for v in (coordinator_address, num_processes, process_id))
  multi = explicit or multihost or any(os.environ.get(k, '1') not in ('', '1') for k in CLUSTER_ENV)
  if multi:
    # CPU devices need a collectives backend to talk across processes (ignored on GPU/TPU).
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  return jax.process_count()


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def tune_host_malloc():
  """One glibc malloc arena, no mmap for large blocks, no trimming; returns whether it applied.

  XLA:CPU allocates each step's temporaries afresh; under glibc's defaults every large one is a new
  mmap, page-faulted in and unmapped again (about 1 GB per step of the (a) benchmark model). With
  these settings the heap keeps and reuses them: benchmarks/train_throughput.py measured +10% tokens/s
  on (a) and +21% on (b) (benchmarks/README.md). The arena limit only holds for threads started afterwards,
  so call it before the first JAX call. Freed host memory stays with the process (its peak is
  unchanged). A no-op where libc is not glibc.
  """
  try:
    libc = ctypes.CDLL('libc.so.6')
  except OSError:
    return False
  done = [libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2 ** 31 - 1))]
  return all(done)


def accelerator_plugin_installed():
  """Whether a GPU/TPU backend for JAX is installed (looked up without starting JAX)."""
  if os.environ.get('JAX_PLATFORMS', '').strip().lower() == 'cpu':
    return False
  plugins = importlib.metadata.entry_points(group='jax_plugins')
  return bool(plugins) or importlib.util.find_spec('libtpu') is not None


def host_malloc_wanted(flag):
  """--host_malloc: 'auto' tunes malloc on CPU-only hosts (where it was measured), 'on'/'off'."""
  return flag == 'on' or (flag == 'auto' and not accelerator_plugin_installed())


class NonFiniteLoss(RuntimeError):
  """The loss or the gradient became NaN or inf."""


class Stopped(Exception):
  """SIGTERM/SIGINT: the run saved a checkpoint at the current step and stopped."""

  def __init__(self, signum, step):
    super().__init__(f'train: stopped by {signal.Signals(signum).name} after step {step}; '
                     'checkpoint saved, rerun the same command to resume')
    self.signum = signum


class IncompatibleResume(ValueError):
  """The workdir's checkpoint was written by a config whose model or data differ."""


# Fields that may change between a run and its resumption (noted, not refused).
SAFE_TO_CHANGE = ('train.steps', 'train.checkpoint_every', 'train.eval_every', 'train.log_every',
                  'train.keep_checkpoints', 'train.eval_batches', 'train.diagnostics',
                  'train.diagnostics_batch', 'train.skip_nonfinite', 'train.learning_rate',
                  'train.warmup_steps', 'train.schedule', 'train.grad_clip_norm',
                  'train.weight_decay', 'model.attention_impl', 'model.dropout', 'data.data_dir',
                  # Layout and precision: Orbax restores into the new shardings; the update is
                  # the same (accumulation), or only rounded differently (compute dtype, remat).
                  'mesh.data', 'mesh.fsdp', 'mesh.tensor', 'mesh.sequence', 'mesh.rules',
                  'train.grad_accum_steps', 'train.compute_dtype', 'model.remat')


def check_resume_config(workdir, config):
  """Compares `config` with the config.json of an existing run in `workdir`.

  Returns the list of safe fields that changed (to note); raises IncompatibleResume naming the
  fields that cannot change under a checkpoint (model shape, data stream, seed, batch size).
  """
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    old = compare.flatten(json.load(f))
  new = compare.flatten(json.loads(config.to_json_best_effort()))
  # A field added to attnlab after the run started is unchanged if it holds its default.
  defaults = compare.flatten(json.loads(default_config.get_config().to_json_best_effort()))
  changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)
                   and not (k not in old and new.get(k) == defaults.get(k)))
  bad = [k for k in changed if k not in SAFE_TO_CHANGE]
  clip = 'train.grad_clip_norm'
  if clip in changed and (old.get(clip, 0) > 0) != (new.get(clip, 0) > 0):
    bad.append(clip)  # clipping on <-> off changes the optimiser state's structure
  if bad:
    raise IncompatibleResume(
        f'cannot resume {workdir}: its checkpoint was trained with different ' + ', '.join(
            f'{k} ({old.get(k)!r} -> {new.get(k)!r})' for k in bad) +
        '; use a new --workdir or the original values')
  return [f'{k} ({old.get(k)!r} -> {new.get(k)!r})' for k in changed]


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


def create_state(config, vocab_size, mesh=None):
  """Builds the model and optimiser; returns (graphdef, optimizer, state pytree).

  With a `mesh` (layers.sharding.make_mesh), the state is placed on it: parameters and buffers by
  their logical axis names under `config.mesh.rules`, the optimiser state like its parameters.

  `state['params']` are the trained `nnx.Param`s; `state['buffers']` every other model variable
  (e.g. the Performer's random features: checkpointed, not optimised; often empty). Rebuild the
  model with `nnx.merge(graphdef, *model_variables(state))`.
  """
  def build():
    return models.build(config.model, vocab_size, config.data.max_length,
                        rngs=nnx.Rngs(params=config.train.seed))

  tx = make_optimizer(config.train)
  if mesh is None:
    graphdef, params, buffers = nnx.split(build(), nnx.Param, ...)
    opt_state = tx.init(params)
  else:
    # Initialised inside jit straight into their shardings: each device computes only its shard,
    # so a model that fits the mesh but not one device can be built (FSDP).
    rules = sharding.rules_of(config.get('mesh', {}))
    graphdef, params, buffers = nnx.split(nnx.eval_shape(build), nnx.Param, ...)
    param_sharding, buffer_sharding = (
        sharding.named(sharding.param_specs(v, mesh, rules), mesh) for v in (params, buffers))
    params, buffers = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[1:],
                              out_shardings=(param_sharding, buffer_sharding))()
    # Each moment lives where its parameter lives; counters are replicated.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_sharding = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, params),
                                         param_sharding, transform_non_params=lambda _: replicated)
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'buffers': buffers,
           'opt_state': opt_state, 'skipped': jnp.zeros((), jnp.int32)}
  if mesh is not None:  # from the host: no device holds anything placed elsewhere afterwards
    state.update(jax.device_put({'step': np.zeros((), np.int32), 'skipped': np.zeros((), np.int32)},
                                replicated))
  return graphdef, tx, state


def make_mesh(config):
  """The device mesh of `config.mesh` (all sizes 1: the first device), or a ConfigError."""
  try:
    return sharding.make_mesh(config.get('mesh', {}))
  except ValueError as e:
    raise validation.ConfigError(str(e)) from None


def place_batch(batch, mesh, rules, first_row=0, batch_size=None):
  """A host batch as global arrays on `mesh`: rows over the batch axes, the length over `sequence`
  (layers.sharding rules); each process fills only the shards its devices hold.

  `batch` holds rows `first_row`, ... of a global batch of `batch_size` rows (default: it is the
  whole batch): with `data.shards`, a process reads only the rows its devices hold.
  """
  def put(x):
    x = np.asarray(x)
    shape = (batch_size or len(x),) + x.shape[1:]
    names = ('batch', 'length') + (None,) * (x.ndim - 2)
    spec = sharding.spec(names[:x.ndim], shape, mesh, rules)

    def local(index):
      start, stop, _ = index[0].indices(shape[0])
      return x[(slice(start - first_row, stop - first_row),) + tuple(index[1:])]
    return jax.make_array_from_callback(shape, jax.sharding.NamedSharding(mesh, spec), local)
  return jax.tree.map(put, batch)


def process_rows(mesh, rules, batch_size, length, devices=None):
  """(start, stop): the span of rows of a `[batch_size, length]` global batch that `devices`
  (default: this process's) hold."""
  spec = sharding.spec(('batch', 'length'), (batch_size, length), mesh, rules)
  indices = jax.sharding.NamedSharding(mesh, spec).devices_indices_map((batch_size, length))
  devices = set(jax.local_devices() if devices is None else devices)
  rows = [index[0].indices(batch_size)[:2] for d, index in indices.items() if d in devices]
  return min(r[0] for r in rows), max(r[1] for r in rows)


def data_shards(config, mesh, rules, devices=None):
  """The `data.shards` a process reads: all of them in a single process; with several, those that
  cover the span of rows its devices (`devices`, default its own) hold: only its own where the
  batch axes split the rows into contiguous blocks per process (the usual layout), every one where
  the batch is replicated over processes."""
  num_shards, batch_size = config.data.get('shards', 1), config.train.batch_size
  if jax.process_count() == 1 and devices is None:
    return range(num_shards)
  start, stop = process_rows(mesh, rules, batch_size, config.data.max_length, devices)
  per = batch_size // num_shards
  return range(start // per, -(-stop // per))


def allgather_ragged(x):
  """Every process's array `x`, whose leading axis may differ in length between processes, as a
  list in process order (a collective: all must call; `[x]` with one process)."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return [x]
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(x))))
  padded = np.zeros((int(sizes.max()),) + x.shape[1:], x.dtype)
  padded[:len(x)] = x
  every = np.asarray(multihost_utils.process_allgather(padded))  # [P, longest, ...]
  return [block[:n] for block, n in zip(every, sizes)]


def allgather_json(obj):
  """Every process's JSON-serialisable `obj`, in process order (a collective: all must call)."""
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  return [json.loads(block.tobytes()) for block in allgather_ragged(data)]


def global_batch(batch, first_row, batch_size):
  """The whole global batch from the processes' row blocks (a collective; for the diagnostics
  pass, at log steps only)."""
  if jax.process_count() == 1:
    return batch
  starts = [int(b[0]) for b in allgather_ragged(np.int32([first_row]))]
  out = {}
  for k, x in batch.items():
    full = np.zeros((batch_size,) + np.shape(x)[1:], np.asarray(x).dtype)
    for start, block in zip(starts, allgather_ragged(x)):
      full[start:start + len(block)] = block  # blocks of processes reading the same rows agree
    out[k] = full
  return out


def model_variables(state):
  """(params, buffers) of a training state: `nnx.merge(graphdef, *model_variables(state))`."""
  return state['params'], state['buffers']


def _merge(graphdef, variables):
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


def compute_metrics(logits, targets, weights):
  """Weighted sums (reduced across batches, then divided): loss, correct tokens, token count."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)  # [B, T]
  return {'loss_sum': jnp.sum(ce * weights), 'correct_sum': jnp.sum(correct * weights),
          'weight_sum': jnp.sum(weights)}


def finalize(sums):
  """Turns summed metrics into means."""
  denom = max(float(sums['weight_sum']), 1.0)
  out = {'loss': float(sums['loss_sum']) / denom, 'accuracy': float(sums['correct_sum']) / denom}
  out.update({k: float(v) for k, v in sums.items() if not k.endswith('_sum')})
  return out


def param_group(path):
  """The diagnostics group of a parameter path: one per Transformer block, else its owner module.

  ('decoder', 'blocks', 3, 'ffn', 'wi', 'kernel') -> 'decoder/blocks/3';
  ('decoder', 'embed', 'embedding') -> 'decoder/embed'; ('decoder', 'final_norm', 'scale') ->
  'decoder/final_norm'. Every parameter is in exactly one group, so the groups' squared norms sum
  to the global squared norm.
  """
  keys = [str(k) for k in path]
  if 'blocks' in keys[:-1]:
    i = keys.index('blocks')
    return '/'.join(keys[:i + 2])
  return '/'.join(keys[:-1][:2]) or keys[0]


def _path_keys(path):
  """A jax key path of an nnx.State leaf -> its plain keys, without the trailing `.value`."""
  keys = [getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))) for k in path]
  return tuple(keys[:-1] if keys and keys[-1] == 'value' else keys)


def _group_sort_key(name):
  return tuple((0, int(p), '') if p.isdigit() else (1, 0, p) for p in name.split('/'))


def _layer_groups(keys, leaf):
  """The per-layer groups of a scanned stack's leaf ('blocks' followed by a name, not a layer
  number; row i of its leading `[L]` axis is layer i), or None for any other leaf."""
  if 'blocks' not in keys[:-1]:
    return None
  i = keys.index('blocks')
  if str(keys[i + 1]).isdigit():
    return None
  return tuple(param_group(keys[:i + 1] + (r,) + keys[i + 1:]) for r in range(leaf.shape[0]))


def param_groups(params):
  """(group names in order, the group index of every leaf of `params`, parameters per group).

  A scanned stack's leaf `[L, ...]` (model.scan_layers) spans L groups: its index is a tuple, one
  group per layer, so the groups are the same blocks as the unrolled model's.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  leaf_names = []
  for path, leaf in leaves:
    keys = _path_keys(path)
    leaf_names.append(_layer_groups(keys, leaf) or param_group(keys))
  flat = [n for name in leaf_names for n in (name if isinstance(name, tuple) else (name,))]
  names = sorted(set(flat), key=_group_sort_key)
  index = {n: i for i, n in enumerate(names)}
  sizes = {n: 0 for n in names}
  for name, (_, leaf) in zip(leaf_names, leaves):
    for n in (name if isinstance(name, tuple) else (name,)):
      sizes[n] += int(np.prod(leaf.shape)) // (len(name) if isinstance(name, tuple) else 1)
  return names, tuple(tuple(index[n] for n in name) if isinstance(name, tuple) else index[name]
                      for name in leaf_names), sizes


def num_groups(leaf_groups):
  """The number of groups of `param_groups`'s leaf indices."""
  return 1 + max(max(g) if isinstance(g, tuple) else g for g in leaf_groups)


def group_sq_norms(tree, leaf_groups, num_groups):
  """`[num_groups]` float32: the sum of squares of the leaves of each group."""
  sq = [jnp.zeros((), jnp.float32)] * num_groups
  for leaf, g in zip(jax.tree.leaves(tree), leaf_groups):
    if isinstance(g, tuple):  # a scanned stack's [L, ...] leaf: row i goes to layer i's group
      rows = jnp.sum(jnp.square(leaf.astype(jnp.float32)).reshape(len(g), -1), 1)  # [L]
      for i, gi in enumerate(g):
        sq[gi] = sq[gi] + rows[i]
    else:
      sq[g] = sq[g] + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
  return jnp.stack(sq)


def count_tokens(batch):
  """Real (non-padding) tokens of a batch, source and target sides together."""
  groups = [k for k in ('segment_ids', 'src_segment_ids', 'tgt_segment_ids') if k in batch]
  if not groups:
    return int(np.sum(batch['weights'] > 0))
  return int(sum(np.sum(batch[k] > 0) for k in groups))


def train_step(graphdef, tx, base_rng, state, batch, leaf_groups=None, skip_nonfinite=False,
               accum_steps=1, compute_dtype='float32'):
  """One optimisation step, a pure function of the state (jit it with the state donated).

  With `accum_steps` = k > 1 the batch is k micro-batches whose gradients of the summed loss are
  accumulated in a scan and divided by the whole batch's weight: the full-batch gradient, with the
  activations of one micro-batch in memory. `compute_dtype` ('bfloat16'): the forward and
  backward passes run on parameters cast to it, while the parameters, their gradients and the
  optimiser stay float32 (and logits, loss and softmax statistics are float32 in the models).

  With `skip_nonfinite`, a step whose loss or gradient norm is not finite leaves the parameters and
  optimiser state unchanged (the data and the step counter still advance) and counts in
  `state['skipped']`.

  With `leaf_groups` (from `param_groups`), `sums['diag']` holds `[G]` squared norms per group of
  the gradient, the update and the parameters before the update (a few reductions: cheap).
  """
  # Fold the step into the key: a resumed run draws the same dropout/masks as an uninterrupted one.
  dropout_rng, mask_rng = jax.random.split(jax.random.fold_in(base_rng, state['step']))

  def sums_fn(params, batch, dropout_rng, mask_rng):
    model = nnx.merge(graphdef, cast_params(params, compute_dtype), state['buffers'])
    logits, targets, weights = model.loss_terms(batch, rngs=nnx.Rngs(dropout=dropout_rng, mask=mask_rng))
    return compute_metrics(logits, targets, weights)

  if accum_steps == 1:
    def loss_fn(params):
      sums = sums_fn(params, batch, dropout_rng, mask_rng)
      return sums['loss_sum'] / jnp.maximum(sums['weight_sum'], 1.0), sums

    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  else:
    # Micro-batch i takes rows i, i + k, i + 2k, ...: each data shard keeps its own rows.
    micro = jax.tree.map(
        lambda x: x.reshape(-1, accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)
    grad_sum = jax.grad(lambda p, *a: (lambda s: (s['loss_sum'], s))(sums_fn(p, *a)), has_aux=True)

    def accumulate(carry, inputs):
      micro_batch, i = inputs
      g, s = grad_sum(state['params'], micro_batch, jax.random.fold_in(dropout_rng, i),
                      jax.random.fold_in(mask_rng, i))
      return jax.tree.map(jnp.add, carry, (g, s)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        grad_sum, state['params'], jax.tree.map(lambda x: x[0], micro), dropout_rng, mask_rng))
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(accum_steps)))
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums['weight_sum'], 1.0), grads)
  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  sums['grad_norm'] = optax.global_norm(grads)
  sums['param_norm'] = optax.global_norm(params)
  if leaf_groups is not None:
    g = num_groups(leaf_groups)
    sums['diag'] = {'grad_sq': group_sq_norms(grads, leaf_groups, g),
                    'update_sq': group_sq_norms(updates, leaf_groups, g),
                    'param_sq': group_sq_norms(state['params'], leaf_groups, g)}
  new = {'step': state['step'] + 1, 'params': params, 'buffers': state['buffers'],
         'opt_state': opt_state, 'skipped': state['skipped']}
  if skip_nonfinite:
    ok = jnp.isfinite(sums['loss_sum']) & jnp.isfinite(sums['grad_norm'])
    new['params'], new['opt_state'] = jax.tree.map(
        lambda a, b: jnp.where(ok, a, b), (params, opt_state),
        (state['params'], state['opt_state']))
    new['skipped'] = state['skipped'] + (~ok).astype(jnp.int32)
    # Report the skipped step's values as zeros so that window sums stay finite.
    for k in ('loss_sum', 'correct_sum', 'weight_sum', 'grad_norm', 'param_norm'):
      sums[k] = jnp.where(ok, sums[k], 0.0)
  return new, sums


COMPUTE_DTYPES = ('float32', 'bfloat16', 'float16')


def cast_params(params, dtype):
  """Floating parameters cast to the compute dtype (a no-op for float32): mixed precision."""
  if dtype == 'float32':
    return params
  return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p,
                      params)


@contextlib.contextmanager
def _capture_blocks(records):
  """While active, every `Block.__call__` appends (block, input, kwargs, output) to `records`.

  Used only while tracing `diagnostic_pass`: the blocks are captured from the model's own forward
  pass (any architecture), without a hook in the layers or a slower train step.
  """
  original = block_lib.Block.__call__

  def capture(self, x, **kwargs):
    y = original(self, x, **kwargs)
    records.append((self, x, kwargs, y))
    return y

  block_lib.Block.__call__ = capture
  try:
    yield
  finally:
    block_lib.Block.__call__ = original


def block_stats(blk, x, kwargs, y):
  """One block's diagnostics: output activation RMS, self-attention max logit and mean entropy.

  The logits are the scaled scores plus the position terms (ALiBi, T5 bias) at visible keys, as the
  softmax sees them; the entropy (nats) is averaged over heads and real query tokens. Attention
  variants without q/k projections report the RMS only.
  """
  seg = kwargs.get('segment_ids')
  real = (jnp.ones(y.shape[:2], jnp.float32) if seg is None
          else (seg > 0).astype(jnp.float32))  # [B, T]
  count = jnp.maximum(jnp.sum(real), 1.0)
  out = {'act_rms': jnp.sqrt(jnp.sum(jnp.mean(jnp.square(y.astype(jnp.float32)), -1) * real) /
                             count)}
  attn = blk.self_attention
  if not all(hasattr(attn, a) for a in ('project', 'scale', 'local_window_size')):
    return out
  h = blk.self_norm(x) if blk.pre else x
  q, k, _ = attn.project(h)  # [B, T, N, H], [B, T, K, H]
  positions, position = kwargs.get('positions'), kwargs.get('position')
  is_causal = kwargs.get('is_causal', False)
  extra = {}
  if position is not None:
    q, k, extra = position.in_attention(q, k, positions, positions, is_causal=is_causal)
  if set(extra) - {'bias', 'alibi_slopes'}:
    return out
  k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)  # [B, S, N, H]: head n reads K-head n // G
  scale = attn.scale if attn.scale is not None else 1.0 / math.sqrt(q.shape[-1])
  logits = jnp.einsum('BTNH,BSNH->BNTS', q.astype(jnp.float32), k.astype(jnp.float32)) * scale
  t = q.shape[1]
  q_pos, k_pos = jnp.arange(t)[:, None], jnp.arange(t)[None, :]  # [T, 1], [1, S]
  if 'bias' in extra:
    logits = logits + extra['bias'].astype(jnp.float32)
  if 'alibi_slopes' in extra:
    logits = logits + masks.alibi_bias(extra['alibi_slopes'], q_pos, k_pos)[None]
  vis = masks.visible(q_pos, k_pos, is_causal=is_causal,
                      window=masks.normalize_window(attn.local_window_size),
                      q_seg=None if seg is None else seg[:, :, None],
                      k_seg=None if seg is None else seg[:, None, :])
  vis = jnp.ones(logits.shape, bool) if vis is None else jnp.broadcast_to(
      vis[:, None] if vis.ndim == 3 else vis, logits.shape)  # [B, N, T, S]
  rows = real[:, None, :] * jnp.any(vis, -1)  # [B, N, T]: real queries that see some key
  neg = jnp.finfo(jnp.float32).min
  out['attn_max_logit'] = jnp.max(jnp.where(vis & (rows[..., None] > 0), logits, neg))
  logp = jax.nn.log_softmax(jnp.where(vis, logits, neg), -1)  # [B, N, T, S]
  entropy = -jnp.sum(jnp.where(vis, jnp.exp(logp) * logp, 0.0), -1)  # [B, N, T]
  out['attn_entropy'] = jnp.sum(entropy * rows) / jnp.maximum(jnp.sum(rows), 1.0)
  return out


def diagnostic_pass(graphdef, variables, batch):
  """Per-block activation RMS and attention max logit/entropy on `batch` (no dropout; jit it).

  `variables`: `model_variables(state)` (or the params alone for a model without buffers).

  Returns:
    {'act_rms/decoder/blocks/0': scalar, 'attn_max_logit/...', 'attn_entropy/...', ...}.
  """
  model = _merge(graphdef, variables)
  # Scanned stacks (model.scan_layers) run here layer by layer, each block its own module named
  # .../blocks/<i> as in an unrolled model (this pass is not differentiated: no remat to keep).
  for stack in [m for _, m in nnx.iter_modules(model) if getattr(m, 'scan_layers', False)]:
    stack.unroll()
  names = {id(m): '/'.join(map(str, path)) for path, m in nnx.iter_modules(model)
           if isinstance(m, block_lib.Block)}
  records = []
  with _capture_blocks(records):
    model.loss_terms(batch)
  out = {}
  for blk, x, kwargs, y in records:
    for key, value in block_stats(blk, x, kwargs, y).items():
      out[f'{key}/{names[id(blk)]}'] = value
  return out


def diagnostic_metrics(groups, diag):
  """Host-side: per-group gradient norm and update/parameter norm ratio, and the global ratio."""
  diag = jax.device_get(diag)
  grad, upd, par = (np.sqrt(np.asarray(diag[k], np.float64))
                    for k in ('grad_sq', 'update_sq', 'param_sq'))
  out = {'update_ratio': float(np.sqrt(np.sum(np.square(upd))) /
                               max(np.sqrt(np.sum(np.square(par))), 1e-30))}
  for i, name in enumerate(groups):
    out[f'grad_norm/{name}'] = float(grad[i])
    out[f'update_ratio/{name}'] = float(upd[i] / par[i]) if par[i] > 0 else 0.0
  return out


def unigram_entropy(batch):
  """Entropy (nats) of the weighted target tokens of one batch: the loss of a unigram model."""
  prefix = 'tgt_' if 'tgt_targets' in batch else ''  # encoder-decoder batches
  targets = np.asarray(batch[f'{prefix}targets']).ravel()
  weights = np.asarray(batch[f'{prefix}weights'], np.float64).ravel()
  counts = np.bincount(targets, weights=weights)
  p = counts[counts > 0] / counts.sum()
  return float(-np.sum(p * np.log(p)))


def _write_json(path, obj):
  with open(path + '.tmp', 'w') as f:
    json.dump(obj, f, indent=2)
  os.replace(path + '.tmp', path)


def eval_step(graphdef, variables, batch):
  """Summed metrics of one batch without dropout; `variables` as in `diagnostic_pass`."""
  model = _merge(graphdef, variables)
  return compute_metrics(*model.loss_terms(batch))


def evaluate(eval_fn, variables, config, split, num_batches, length=None):
  """Mean loss/accuracy over the first `num_batches` batches (0 = all) of `split`, in order."""
  return finalize(evaluate_sums(eval_fn, variables, config, split, num_batches, length))


def evaluate_sums(eval_fn, variables, config, split, num_batches, length=None, share=(0, 1)):
  """The summed metrics of `evaluate`; with `share` = (i, n), only of batches i, i + n, ... (one
  process's part of a split that n processes evaluate side by side; their sums add up)."""
  it = pipeline.make_iterator(config.data, split, config.train.batch_size,
                              arch=models.batch_format(config.model.arch),
                              loss_on=config.train.loss_on, shuffle=False, repeat=False,
                              drop_remainder=False, length=length)
  index, count = share
  total = {'loss_sum': 0.0, 'correct_sum': 0.0, 'weight_sum': 0.0}
  for i, batch in enumerate(it):
    if num_batches and i >= num_batches:
      break
    if i % count == index:
      total = jax.tree.map(jnp.add, total, eval_fn(variables, batch))
  return total


def checkpoint_manager(workdir, config):
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, 'checkpoints')),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.train.keep_checkpoints, create=True))


def restore_state(mngr, state, step=None):
  """Restores (state, data iterator state) of `step` (default newest) into the structure of `state`."""
  step = mngr.latest_step() if step is None else step

  def restore(target):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    return mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))

  try:
    restored = restore(state)
  except Exception:  # pylint: disable=broad-except
    if jax.tree.leaves(state.get('buffers', {})):
      raise
    # Checkpoints written before model buffers existed hold no 'buffers' entry; a model without
    # buffers restores from them as it did (a damaged checkpoint fails here again and is raised).
    restored = restore({k: v for k, v in state.items() if k != 'buffers'})
    return {**restored['state'], 'buffers': state['buffers']}, restored['data']
  return restored['state'], restored['data']


def restore_newest_good(mngr, state, workdir):
  """Restores the newest readable checkpoint; unreadable ones are reported and moved aside.

  Orbax commits a checkpoint atomically (a temporary directory renamed when complete), so a crash
  mid-save leaves no half-written step; this guards against damage after the commit (files
  truncated or missing). Returns (state, data state, step) or None when no checkpoint is readable.
  """
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      restored, data_state = restore_state(mngr, state, step)
      return restored, data_state, step
    except Exception as e:  # pylint: disable=broad-except  # orbax/tensorstore raise many kinds
      path = os.path.join(mngr.directory, str(step))
      aside = os.path.join(mngr.directory, f'corrupt-{step}-{int(time.time())}')
      reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
      print(f'train: checkpoint step {step} in {workdir} is unreadable ({reason}); moved to '
            f'{aside}, trying the previous one', file=sys.stderr)
      os.rename(path, aside)
      mngr.reload()
  return None


class NullWriter:
  """The MetricsWriter of processes other than 0."""

  def write(self, step, split, metrics):
    pass

  def close(self):
    pass


class MetricsWriter:
  """Appends metrics to metrics.jsonl and TensorBoard; on resume, drops rows after the restart step."""

  def __init__(self, workdir, resume_step):
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self.path = os.path.join(workdir, 'metrics.jsonl')
    if os.path.exists(self.path):
      with open(self.path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)['step'] <= resume_step]
      with open(self.path, 'w') as f:
        f.writelines(rows)
    self.file = open(self.path, 'a')
    self.tb = SummaryWriter(workdir, purge_step=resume_step + 1 if resume_step else None)

  def write(self, step, split, metrics):
    self.file.write(json.dumps({'step': step, 'split': split, **metrics}) + '\n')
    self.file.flush()
    for key, value in metrics.items():
      self.tb.add_scalar(f'{split}/{key}', value, step)

  def close(self):
    self.file.close()
    self.tb.close()


def agreed_signal(received):
  """The signal that stops the run after this step (0: none), the same in every process.

  Processes of one run may be sent SIGTERM at different steps (a preemption notice reaches hosts
  one by one); a process that saved and left alone would leave the others waiting in the next
  step's collectives, and its own save waiting for theirs. So they share what they received after
  every step (one small all-gather; nothing with a single process) and all stop together.
  """
  mine = received[0] if received else 0
  if jax.process_count() == 1:
    return mine
  return int(np.max(multihost_utils.process_allgather(np.int32(mine))))


def train_and_evaluate(config, workdir, _interrupt_after=None, _sigterm_after=None):
  """Trains `config` in `workdir`, resuming if a checkpoint exists. Returns the last train metrics.

  `_interrupt_after` (tests only) raises KeyboardInterrupt after that step, as a kill would;
  `_sigterm_after` (tests only) sends this process SIGTERM after that step.
  """
  os.makedirs(workdir, exist_ok=True)
  lead = jax.process_index() == 0  # multi-process: only process 0 writes logs and reports
  for change in check_resume_config(workdir, config):
    if lead:
      print(f'train: resuming with changed {change}', file=sys.stderr)
  if lead:
    path = os.path.join(workdir, 'config.json')
    with open(path + '.tmp', 'w') as f:  # other processes may be reading it (resume check)
      f.write(config.to_json_best_effort(indent=2))
    os.replace(path + '.tmp', path)
  t = config.train
  tokenizer = pipeline.get_tokenizer(config.data)
  mesh = make_mesh(config)
  rules = sharding.rules_of(config.get('mesh', {}))
  graphdef, tx, state = create_state(config, tokenizer.vocab_size, mesh)
  # Rows first_row, ... of every global batch: all of it, or with data.shards and several
  # processes the shards of the rows this process's devices hold.
  it = pipeline.ShardedIterator(config.data, 'train', t.batch_size, config.data.get('shards', 1),
                                data_shards(config, mesh, rules),
                                arch=models.batch_format(config.model.arch), loss_on=t.loss_on,
                                seed=t.seed)
  mngr = checkpoint_manager(workdir, config)
  start = 0
  restored = restore_newest_good(mngr, state, workdir) if mngr.all_steps() else None
  if restored is not None:
    state, data_state, _ = restored
    it.set_state(data_state)
    start = int(state['step'])
    print(f'train: resumed from step {start} in {workdir}', file=sys.stderr)
  writer = MetricsWriter(workdir, start) if lead else NullWriter()

  # The parameter count per group goes to run_info.json (metrics.jsonl rows all carry a loss).
  groups, leaf_groups, group_sizes = param_groups(state['params'])
  info_path = os.path.join(workdir, 'run_info.json')
  info = {}
  if os.path.exists(info_path):
    with open(info_path) as f:
      info = json.load(f)
  info.update(num_params=sum(group_sizes.values()), params_by_group=group_sizes)
  if lead:
    _write_json(info_path, info)

  base_rng = jax.random.key(t.seed)

  def in_mesh(fn):  # traced (on the first call) under the mesh (ring attention reads it) and
    def call(*args):  # with the activation sharding rules active
      with jax.set_mesh(mesh), sharding.use_rules(mesh, rules):
        return fn(*args)
    return call

  # The state keeps its layout step after step; the metrics come back replicated.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step_fn = in_mesh(jax.jit(functools.partial(train_step, graphdef, tx, base_rng,
                                              leaf_groups=leaf_groups if t.diagnostics else None,
                                              skip_nonfinite=t.skip_nonfinite,
                                              accum_steps=t.get('grad_accum_steps', 1),
                                              compute_dtype=t.get('compute_dtype', 'float32')),
                            donate_argnums=(0,),
                            out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated)))
  diag_fn, eval_fn = (
      (lambda jitted: lambda variables, batch: jitted(variables, place_batch(batch, mesh, rules)))(
          in_mesh(jax.jit(functools.partial(fn, graphdef))))
      for fn in (diagnostic_pass, eval_step))
  schedule = make_schedule(t)
  # Layers that redraw random features every R steps (the Performer; see redraw_features).
  model = nnx.merge(graphdef, *model_variables(state))
  redraw_periods = {m.redraw_every for _, m in nnx.iter_modules(model)
                    if getattr(m, 'redraw_every', 0) > 0}
  del model
  window, window_steps, window_tokens, window_start = None, 0, 0, time.perf_counter()
  last = {}
  bar = tqdm.tqdm(total=t.steps, initial=start, desc='train', mininterval=1.0, file=sys.stderr,
                  dynamic_ncols=True, disable=not lead)

  def save(step):
    # Process 0 writes the data position: every shard's, gathered from the processes reading them.
    data_state = pipeline.ShardedIterator.merge_states(allgather_json(it.get_state()))
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=ocp.args.JsonSave(data_state)))

  # SIGTERM (preemption) and SIGINT finish the current step, save, and stop (see Stopped).
  received = []
  handlers = {}
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      handlers[signum] = signal.signal(signum, lambda signum, _: received.append(signum))
  try:
    for step in range(start + 1, t.steps + 1):
      batch = next(it)
      # Features due at this step are drawn before it, so that a checkpoint or evaluation after
      # step s holds the draw step s trained with.
      if step > 1 and any((step - 1) % r == 0 for r in redraw_periods):
        state = redraw_features(graphdef, state, step - 1)
      state, sums = step_fn(state, place_batch(batch, mesh, rules, it.first_row, t.batch_size))
      diag = sums.pop('diag', None)  # per-group [G] norms, read at log steps only
      # Read the loss every step: a non-finite value must stop the run before it is checkpointed.
      loss = float(sums['loss_sum']) / max(float(sums['weight_sum']), 1.0)
      grad_norm = float(sums['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        writer.write(step, 'train', {'loss': loss})  # so that sweep comparisons see the divergence
        name, value = ('loss', loss) if not math.isfinite(loss) else ('grad_norm', grad_norm)
        raise NonFiniteLoss(f'train: non-finite {name} ({value}) at step {step}; stopping. The '
                            f'last good checkpoint is step {mngr.latest_step()} in {workdir} '
                            '(train.skip_nonfinite=True skips such steps instead)')
      if step == 1 and diag is not None and lead:
        # Step 1's gradient is taken at the initial parameters (Xiong et al. 2020, Figure 3).
        grad = np.sqrt(np.asarray(jax.device_get(diag['grad_sq']), np.float64))
        _write_json(os.path.join(workdir, 'init_grad_norms.json'), {
            'grad_norm': float(np.sqrt(np.sum(np.square(grad)))),
            'groups': dict(zip(groups, map(float, grad))),
            'blocks': [float(v) for n, v in zip(groups, grad) if '/blocks/' in f'/{n}'],
            'norm_position': config.model.norm_position, 'num_layers': config.model.num_layers})
      if 'unigram_entropy' not in info:  # the level compare's plateau rule uses
        info['unigram_entropy'] = unigram_entropy(global_batch(batch, it.first_row, t.batch_size))
        if lead:
          _write_json(info_path, info)
      window = sums if window is None else jax.tree.map(jnp.add, window, sums)
      window_steps += 1
      # This process's rows, scaled to the global batch where it reads only some.
      window_tokens += count_tokens(batch) * t.batch_size / len(next(iter(batch.values())))
      bar.update(1)
      if step % t.log_every == 0 or step == t.steps:
        elapsed = time.perf_counter() - window_start
        last = finalize(window)
        last['grad_norm'] = float(window['grad_norm']) / window_steps
        last['param_norm'] = float(sums['param_norm'])
        last['learning_rate'] = float(schedule(step - 1))
        last['tokens_per_sec'] = window_tokens / elapsed
        if t.skip_nonfinite:
          last['skipped_steps'] = int(state['skipped'])
        if diag is not None:  # the log step's values (not window means)
          last.update(diagnostic_metrics(groups, diag))
          rows = t.diagnostics_batch or t.batch_size
          whole = global_batch(batch, it.first_row, t.batch_size)
          last.update({k: float(v) for k, v in diag_fn(
              model_variables(state), jax.tree.map(lambda a: a[:rows], whole)).items()})
        writer.write(step, 'train', last)
        bar.set_postfix(loss=f'{last["loss"]:.3f}', tok_s=f'{last["tokens_per_sec"]:.0f}')
        window, window_steps, window_tokens, window_start = None, 0, 0, time.perf_counter()
      if step % t.eval_every == 0 or step == t.steps:
        writer.write(step, 'valid', evaluate(eval_fn, model_variables(state), config,
                                             'validation', t.eval_batches))
      if _sigterm_after == step:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
      stop = agreed_signal(received)
      if step % t.checkpoint_every == 0 or step == t.steps or stop:
        save(step)
      if stop:
        raise Stopped(stop, step)
      if _interrupt_after == step:
        raise KeyboardInterrupt(f'test interruption after step {step}')
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
  return last


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
  if host_malloc_wanted(FLAGS.host_malloc):
    tune_host_malloc()
  if FLAGS.sweep:
    from tools import sweep  # pylint: disable=g-import-not-at-top
    if not FLAGS.sweep_dir:
      print('train: --sweep needs --sweep_dir', file=sys.stderr)
      sys.exit(2)
    try:
      results = sweep.run_sweep(FLAGS.sweep, FLAGS.sweep_dir, seeds=FLAGS.seeds,
                                dry_run=FLAGS.dry_run, parallel=FLAGS.parallel,
                                run_eval=FLAGS.sweep_eval)
    except sweep.SweepError as e:
      print(f'sweep error: {e}', file=sys.stderr)
      sys.exit(2)
    sys.exit(0 if all(r in ('done', 'skipped', 'diverged', 'dry_run')
                      for r in results.values()) else 1)
  if FLAGS.config is None or FLAGS.workdir is None:
    print('train: --config and --workdir are required (or --sweep and --sweep_dir)',
          file=sys.stderr)
    sys.exit(2)
  init_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                   FLAGS.multihost)
  config = validation.resolve(FLAGS.config.unlock())
  try:
    validation.validate(config)
    validation.check_writable('workdir', FLAGS.workdir)
    validation.check_writable('data.data_dir', config.data.data_dir)
  except validation.ConfigError as e:
    print(f'config error: {e}', file=sys.stderr)
    sys.exit(2)
  try:
    train_and_evaluate(config, FLAGS.workdir, _sigterm_after=FLAGS.test_sigterm_after)
  except IncompatibleResume as e:
    print(f'train: {e}', file=sys.stderr)
    sys.exit(2)
  except NonFiniteLoss as e:
    print(str(e), file=sys.stderr)
    sys.exit(1)
  except Stopped as e:
    print(str(e), file=sys.stderr)
    sys.exit(128 + e.signum)  # the shell's convention for "ended by this signal"


if __name__ == '__main__':
  define_flags()
  app.run(main)
