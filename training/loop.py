"""The training loop: `train_and_evaluate(config, workdir, hooks=...)`, resuming where a run
stopped."""

import collections
import contextlib
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from data import pipeline
from data import python_code
from data import text_corpus
from layers import sharding
import models
from models import accounting
from training import callbacks as callbacks_lib
from training import checkpointing
from training import distributed
from training import diagnostics
from training import lock
from training import paths
from training import persist
from training import state as state_lib
from training import steps
from training import writers


NonFiniteLoss = callbacks_lib.NonFiniteLoss  # re-exported: train.py and tests catch loop.*
Stopped = callbacks_lib.Stopped


def empty_log_sums():
  """The device-side sums of the steps since the last log row, and the first non-finite step."""
  ints = ('steps', 'first_bad')  # one buffer each: the sums are donated to `accumulate`
  return {k: jnp.zeros((), jnp.int32 if k in ints else jnp.float32) for k in (
      'loss_sum', 'correct_sum', 'weight_sum', 'grad_norm', 'steps', 'param_norm', 'first_bad',
      'bad_loss', 'bad_grad_norm', steps.Z_LOSS_SUM, *steps.MOE_METRICS)}


@functools.partial(jax.jit, donate_argnums=(0,))
def accumulate(log_sums, sums, step):
  """Adds one step's sums to the log sums on the device (no transfer to the host), and keeps the
  first step whose loss or gradient norm is not finite, with those values."""
  acc = log_sums
  loss = sums['loss_sum'] / jnp.maximum(sums['weight_sum'], 1.0)
  first = (acc['first_bad'] == 0) & ~(jnp.isfinite(loss) & jnp.isfinite(sums['grad_norm']))
  out = {k: acc[k] + sums[k] for k in ('loss_sum', 'correct_sum', 'weight_sum', 'grad_norm')}
  # The z-loss sum and MoE models' balancing terms (0 when off), summed like the loss; the row
  # has their means (per token of weight, per step).
  out.update({k: acc[k] + sums.get(k, 0.0) for k in (steps.Z_LOSS_SUM, *steps.MOE_METRICS)})
  out.update(steps=acc['steps'] + 1, param_norm=sums['param_norm'],
             first_bad=jnp.where(first, step, acc['first_bad']),
             bad_loss=jnp.where(first, loss, acc['bad_loss']),
             bad_grad_norm=jnp.where(first, sums['grad_norm'], acc['bad_grad_norm']))
  return out


def prefetched(it, place, depth=2):
  """Yields (host batch, data state after it, device batch) with `depth` batches placed ahead, so
  that the next batch's transfer overlaps the current step. The data state is the iterator's as of
  that batch (not of the prefetched ones): what a checkpoint after its step must hold."""
  queue = collections.deque()
  while True:
    while len(queue) < depth:
      batch = next(it)
      queue.append((batch, it.get_state(), place(batch)))
    yield queue.popleft()


def store_lost(error, good, workdir):
  """The one-line RunFailed of an object store that stopped answering mid-run (after the storage
  clients' own retries: gcsfs tries a request 6 times over about 35 s); `good` is the newest
  checkpoint step whose save was confirmed (None: none)."""
  host, port = paths.store_endpoint()
  reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
  return checkpointing.RunFailed(
      f'train: the object store {host}:{port} of {workdir} stopped answering '
      f'({type(error).__name__}'
      f': {reason}); the last good checkpoint is step {good if good is not None else "none"}; '
      'rerun the same command once it is back (its threads\' traces, if any: '
      f'{checkpointing.background_log(workdir)})')


def jit_train_step(config, graphdef, tx, state, mesh, leaf_groups, compiler_options=None):
  """The jitted `steps.train_step` of `config.train` (state donated): the state keeps its layout
  (`state`'s shardings, concrete or abstract) step after step, the metrics come back replicated.
  Call it (or lower it) under `jax.set_mesh(mesh)` and `layers.sharding.use_rules`.
  `compiler_options`: XLA's, as `jax.jit` takes them (None: XLA's defaults, as train.py runs)."""
  t = config.train
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(
      functools.partial(steps.train_step, graphdef, tx, jax.random.key(t.seed),
                        leaf_groups=leaf_groups if t.diagnostics else None,
                        skip_nonfinite=t.skip_nonfinite, accum_steps=t.grad_accum_steps,
                        compute_dtype=t.compute_dtype, loss_chunk=t.loss_chunk,
                        moe_loss=(config.model.moe_aux_loss, config.model.moe_z_loss),
                        z_loss=t.z_loss),
      donate_argnums=(0,), out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated),
      compiler_options=compiler_options)


def train_and_evaluate(config, workdir, hooks=()):
  """Trains `config` in `workdir`, resuming if a checkpoint exists. Returns the last train metrics.

  The host never waits for the device between log steps: steps are dispatched ahead, the next
  batch is placed while the current step runs, and the losses stay on the device until a log step
  or a save reads them. No checkpoint holds parameters from a non-finite step: a save first checks
  the device-side flag of the first such step.

  Args:
    config: a validated config (`training.validation.resolve` + `validate`).
    workdir: the run's directory (config.json, checkpoints/, metrics.jsonl, TensorBoard events).
    hooks: the extension API: `training.callbacks.Callback`s (with `every=N`, any of `start`,
      `before_step`, `after_step`/`at_step`, `close`, each given the step's `StepRecord` and
      returning an `Action` or None), or plain callables `hook(step, state)` run after every
      step. Both run after the step's logging and evaluation and before its checkpoint and stop
      decision (the persist phase); e.g. a test that sends SIGTERM or raises at a chosen step.
      `state` is the training state pytree (reading it waits for the device).
  """
  paths.makedirs(workdir)  # local or gs:// (training.paths)
  lead = jax.process_index() == 0  # multi-process: only process 0 writes logs and reports
  with lock.WorkdirLock(workdir) if lead else contextlib.nullcontext():
    with checkpointing.quiet_background_errors(workdir):
      return _train(config, workdir, hooks, lead)


def _train(config, workdir, hooks, lead):
  """`train_and_evaluate` in a workdir this run holds: set up, then the step loop."""
  run, record = _setup(config, workdir, lead)
  t = config.train
  checkpointer = persist.Checkpointer(config, persist.StopSignals(), run.start)
  callbacks = [
      callbacks_lib.FeatureRedraw(run.redraw_periods),
      callbacks_lib.ProfilerCallback(callbacks_lib.Profiler(t.get('profile_steps', ''), workdir)),
      callbacks_lib.InitGradients(),
      callbacks_lib.UnigramEntropy(),
      callbacks_lib.Logger(config, run.start, lead),
      callbacks_lib.Evaluator(config),
      *(h if isinstance(h, callbacks_lib.Callback) else callbacks_lib.Hook(h) for h in hooks),
      checkpointer,  # PERSIST: after every row of its step, wherever it is listed
  ]
  return _run_steps(record, callbacks_lib.by_phase(callbacks), checkpointer)


def _apply(record, callbacks, method, *args):
  """Each callback's `method(*args, record)`, in order, each seeing the record as the `Action`s of
  the ones before it left it (a failure is raised at once). Returns the last record."""
  for cb in callbacks:
    action = getattr(cb, method)(*args, record)
    if action is None:
      continue
    if action.fail is not None:
      raise action.fail
    if action.state is not None:
      record = dataclasses.replace(record, state=action.state)
    if action.row is not None:  # a log row is written: the next window starts
      record = dataclasses.replace(record, last=action.row, log_sums=empty_log_sums())
    if action.stop and not record.stop:  # the first asked wins; the persist phase saves first
      record = dataclasses.replace(record, stop=action.stop)
  return record


def _run_steps(record, callbacks, checkpointer):
  """The step loop: each step is dispatched without waiting for the device (the callbacks read it
  only when due), the next batch placed while it runs. Returns the last train row."""
  run = record.run
  t = run.config.train
  batches = prefetched(run.it, lambda b: distributed.place_batch(
      b, run.mesh, run.rules, run.it.first_row, t.batch_size))
  record = _apply(record, callbacks, 'start')
  failing = True  # until the loop ends normally
  try:
    for step in range(run.start + 1, t.steps + 1):
      batch, data_position, device_batch = next(batches)
      record = dataclasses.replace(record, step=step, batch=batch, data_position=data_position)
      record = _apply(record, callbacks, 'before_step', step)
      state, sums = run.step_fn(record.state, device_batch)
      diag = sums.pop('diag', None)  # per-group [G] norms, read at log steps only
      record = dataclasses.replace(record, state=state, diag=diag,
                                   log_sums=accumulate(record.log_sums, sums, step))
      record = _apply(record, callbacks, 'after_step', step)
      if record.stop:  # a signal a hook sends is seen by the Checkpointer, which saved this step
        raise callbacks_lib.Stopped(record.stop, step)
    checkpointing.confirm_saved(run.mngr, run.workdir)  # the last save's outcome: fails exit 1
    failing = False
  except Exception as e:
    if not (paths.is_remote(run.workdir) and paths.is_storage_error(e)):
      raise
    raise store_lost(e, checkpointer.good, run.workdir) from None
  finally:
    for cb in callbacks:
      cb.close(record)
    _close(run, failing)
  return record.last


def _close(run, failing):
  """The checkpoint manager and the logs, once the loop has ended (normally or not)."""
  try:
    run.mngr.wait_until_finished()
    run.mngr.close()
  except Exception:  # noqa: BLE001
    pass
  try:
    run.writer.close()  # flushes TensorBoard's events: a full disk fails here too
  except Exception as e:  # noqa: BLE001
    if not failing:  # after a failed save, say, that failure's one line says it all
      print(f'train: closing the logs in {run.workdir} failed ({e.strerror or e}); '
            'metrics.jsonl holds every row written before', file=sys.stderr)


def _setup(config, workdir, lead):
  """(the run's frozen `callbacks.RunContext`, the `callbacks.StepRecord` it starts from): its
  state built, or restored from the newest readable checkpoint (or a fine-tune's source),
  config.json and run_info.json written, the jitted steps."""
  for change in checkpointing.check_resume_config(workdir, config):
    if lead:
      print(f'train: resuming with changed {change}', file=sys.stderr)
  t = config.train
  tokenizer = pipeline.get_tokenizer(config.data)
  mesh = distributed.make_mesh(config)
  rules = sharding.rules_of(config.get('mesh', {}))
  vocab_size = state_lib.model_vocab_size(config, tokenizer.vocab_size)
  graphdef, tx, state = state_lib.create_state(
      config, vocab_size, mesh,
      special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  # Rows first_row, ... of every global batch: all of it, or with data.shards and several
  # processes the shards of the rows this process's devices hold.
  it = pipeline.ShardedIterator(config.data, 'train', t.batch_size, config.data.get('shards', 1),
                                distributed.data_shards(config, mesh, rules),
                                batch_format=models.batch_format(config.model.arch),
                                loss_on=t.loss_on, seed=t.seed)
  mngr = checkpointing.checkpoint_manager(workdir, config)
  state, start, carried = _restore(config, workdir, mngr, state, it)
  if lead:  # atomically (other processes may be reading it); only now that the checkpoint
    # fits: a run refused at its resume leaves the config.json of the run that wrote the checkpoint
    paths.write_text(paths.join(workdir, 'config.json'), config.to_json_best_effort(indent=2))
  writer = writers.MetricsWriter(workdir, start) if lead else writers.NullWriter()
  # The parameter groups: the jitted step's per-group norms and run_info.json's counts.
  groups, leaf_groups, group_sizes = diagnostics.param_groups(state['params'])
  info_path = paths.join(workdir, 'run_info.json')
  info = _write_run_info(config, info_path, group_sizes, lead, vocab_size)
  step_fn, diag_fn, eval_fn = _jitted(config, graphdef, tx, state, mesh, rules, leaf_groups)
  # Layers that redraw random features every R steps (the Performer; see redraw_features).
  model = nnx.merge(graphdef, *state_lib.model_variables(state))
  redraw_periods = frozenset(m.redraw_every for _, m in nnx.iter_modules(model)
                             if getattr(m, 'redraw_every', 0) > 0)
  run = callbacks_lib.RunContext(
      config=config, workdir=workdir, lead=lead, mesh=mesh, rules=rules, graphdef=graphdef, it=it,
      mngr=mngr, writer=writer,
      start=start, groups=tuple(groups), leaf_groups=leaf_groups, info_path=info_path, info=info,
      redraw_periods=redraw_periods, step_fn=step_fn, diag_fn=diag_fn, eval_fn=eval_fn)
  return run, callbacks_lib.StepRecord(run=run, step=start, state=state,
                                       log_sums=_carried_log_sums(carried))


def _jitted(config, graphdef, tx, state, mesh, rules, leaf_groups):
  """(train step, diagnostic pass, eval step), jitted, each traced and run under the mesh."""

  def in_mesh(fn):  # traced (on the first call) under the mesh (ring attention reads it) and
    def call(*args):  # with the activation sharding rules active
      with jax.set_mesh(mesh), sharding.use_rules(mesh, rules):
        return fn(*args)
    return call

  def placed(fn):
    return lambda variables, batch: fn(variables, distributed.place_batch(batch, mesh, rules))
  diag_fn, eval_fn = (placed(in_mesh(jax.jit(functools.partial(fn, graphdef))))
                      for fn in (diagnostics.diagnostic_pass, steps.eval_step))
  return (in_mesh(jit_train_step(config, graphdef, tx, state, mesh, leaf_groups)), diag_fn,
          eval_fn)


def _carried_log_sums(carried=None):
  """The log sums a run starts with: empty, or with the sums of the resumed window's steps before
  the checkpoint (`carried`), so that the window's row is whole."""
  log_sums = empty_log_sums()
  if carried:
    log_sums.update({k: jnp.asarray(carried[k], log_sums[k].dtype)
                     for k in callbacks_lib.LOG_SUM_KEYS + steps.MOE_METRICS
                     if k in carried})  # MoE, z-loss sums: absent from older checkpoints
  return log_sums


def _restore(config, workdir, mngr, state, it):
  """(state, start step, carried log sums): the newest readable checkpoint's, else a fine-tune's
  source parameters at step 0 (train.init_from), else the fresh state."""
  t = config.train
  restored = checkpointing.restore_newest_good(mngr, state, workdir) if mngr.all_steps() else None
  if restored is not None:
    state, data_state, start, carried = restored
    if data_state:  # tools.hf import's step 0 holds none: the data starts from the beginning
      it.set_state(data_state)
    print(f'train: resumed from step {start} in {workdir}', file=sys.stderr)
    return state, start, carried
  if t.get('init_from'):
    # A fine-tune's step 0: another run's parameters, a fresh optimiser and schedule (a run with
    # checkpoints of its own resumed from them above instead).
    state, source_step = state_lib.init_from(state, t.init_from)
    print(f'train: parameters from {t.init_from} (its step {source_step}); starting at step 0',
          file=sys.stderr)
  return state, 0, None


def _write_run_info(config, info_path, group_sizes, lead, vocab_size):
  """run_info.json (written by the lead process): the parameter count per group (metrics.jsonl
  rows all carry a loss), the training FLOPs per token and of the whole run (a Transformer's:
  `accounting.training_flops_per_token` x train.batch_size x data.max_length x train.steps, what
  a tools.sweep ladder matches its budgets with), and the corpus fingerprint eval.py and a resume
  compare the files with. Returns what it holds."""
  info = paths.read_json(info_path) if paths.exists(info_path) else {}
  info.update(num_params=sum(group_sizes.values()), params_by_group=group_sizes)
  if accounting.covers(config.model.arch):
    # The decoder's self-attention cache per token, all layers (models.accounting; None without
    # a decoder): what its variant declares (2·K·H a layer, MLA's d_c + d_h^R).
    info['kv_cache_per_token'] = accounting.kv_cache_per_token(config.model)
    length = config.data.max_length
    info['flops_per_token'] = accounting.training_flops_per_token(config.model, vocab_size, length)
    info['train_flops'] = (info['flops_per_token'] * config.train.batch_size * length
                           * config.train.steps)
  spec = pipeline.text_spec(config.data)
  if spec is not None:
    info.setdefault('corpus', text_corpus.fingerprint(spec))
  if config.data.get('task') == python_code.TASK:  # the interpreter and file list trained on
    info.setdefault('python_code', python_code.corpus_of(config.data).record())
  if lead:
    writers.write_json(info_path, info)
  return info
