"""The training loop: `train_and_evaluate(config, workdir, hooks=...)`, resuming where a run stopped."""

import collections
import contextlib
import functools
import math
import os
import signal
import sys
import threading
import time

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from flax import nnx
import numpy as np
import orbax.checkpoint as ocp
import tqdm

from data import pipeline
from data import text_corpus
from layers import sharding
import models
from training import checkpointing
from training import distributed
from training import diagnostics
from training import evaluation
from training import lock
from training import paths
from training import state as state_lib
from training import steps
from training import writers


class NonFiniteLoss(checkpointing.RunFailed):
  """The loss or the gradient became NaN or inf."""


class Stopped(Exception):
  """SIGTERM/SIGINT: the run saved a checkpoint at the current step and stopped."""

  def __init__(self, signum, step):
    super().__init__(f'train: stopped by {signal.Signals(signum).name} after step {step}; '
                     'checkpoint saved, rerun the same command to resume')
    self.signum = signum


WINDOW_KEYS = ('loss_sum', 'correct_sum', 'weight_sum', 'grad_norm', 'steps')


def empty_window():
  """The device-side sums of the steps since the last log row, and the first non-finite step."""
  ints = ('steps', 'first_bad')  # one buffer each: the window is donated to `accumulate`
  return {k: jnp.zeros((), jnp.int32 if k in ints else jnp.float32) for k in (
      'loss_sum', 'correct_sum', 'weight_sum', 'grad_norm', 'steps', 'param_norm', 'first_bad',
      'bad_loss', 'bad_grad_norm')}


@functools.partial(jax.jit, donate_argnums=(0,))
def accumulate(window, sums, step):
  """Adds one step's sums to the window on the device (no transfer to the host), and keeps the
  first step whose loss or gradient norm is not finite, with those values."""
  loss = sums['loss_sum'] / jnp.maximum(sums['weight_sum'], 1.0)
  first = (window['first_bad'] == 0) & ~(jnp.isfinite(loss) & jnp.isfinite(sums['grad_norm']))
  out = {k: window[k] + sums[k] for k in ('loss_sum', 'correct_sum', 'weight_sum', 'grad_norm')}
  out.update(steps=window['steps'] + 1, param_norm=sums['param_norm'],
             first_bad=jnp.where(first, step, window['first_bad']),
             bad_loss=jnp.where(first, loss, window['bad_loss']),
             bad_grad_norm=jnp.where(first, sums['grad_norm'], window['bad_grad_norm']))
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


class StopSignals:
  """SIGTERM (preemption) and SIGINT: finish the current step, save, stop, all processes alike.

  One process: a Python handler records the signal. Several: JAX's preemption service (the
  coordination service's sync point; SIGTERM reaching any host) names one step at which every
  process stops, with no collective of ours per step; SIGINT is turned into that notice.
  """

  def __init__(self):
    self.received, self.handlers = [], {}
    self.multi = jax.process_count() > 1
    if threading.current_thread() is not threading.main_thread():
      return
    for signum in ((signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)):
      self.handlers[signum] = signal.signal(signum, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.received.append(signum)
    if self.multi:  # JAX's notifier listens for SIGTERM: let it tell the other processes
      os.kill(os.getpid(), signal.SIGTERM)

  def stop_after(self, step):
    """The signal to stop after `step` with (0: go on)."""
    if self.multi:
      return signal.SIGTERM if multihost_utils.reached_preemption_sync_point(step) else 0
    return self.received[0] if self.received else 0

  def restore(self):
    for signum, handler in self.handlers.items():
      signal.signal(signum, handler)


class Profiler:
  """`train.profile_steps='START,END'`: a jax.profiler trace of those steps in WORKDIR/profile
  (TensorBoard's profile plugin, or the perfetto_trace.json.gz in Perfetto)."""

  def __init__(self, spec, workdir):
    self.steps = tuple(int(s) for s in spec.split(',')) if spec else None
    self.dir, self.active = paths.join(workdir, 'profile'), False

  def before(self, step):
    if self.steps and step == self.steps[0]:
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.active = True

  def after(self, step, state):
    if self.active and step == self.steps[1]:
      self.stop(state)

  def stop(self, state):
    if self.active:
      jax.block_until_ready(state)  # the trace holds the device work of its steps
      jax.profiler.stop_trace()
      self.active = False


def store_lost(error, good, workdir):
  """The one-line RunFailed of an object store that stopped answering mid-run (after the storage
  clients' own retries: gcsfs tries a request 6 times over about 35 s); `good` is the newest
  checkpoint step whose save was confirmed (None: none)."""
  host, port = paths.store_endpoint()
  reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
  return checkpointing.RunFailed(
      f'train: the object store {host}:{port} of {workdir} stopped answering ({type(error).__name__}'
      f': {reason}); the last good checkpoint is step {good if good is not None else "none"}; '
      'rerun the same command once it is back')


def jit_train_step(config, graphdef, tx, state, mesh, leaf_groups):
  """The jitted `steps.train_step` of `config.train` (state donated): the state keeps its layout
  (`state`'s shardings, concrete or abstract) step after step, the metrics come back replicated.
  Call it (or lower it) under `jax.set_mesh(mesh)` and `layers.sharding.use_rules`."""
  t = config.train
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.jit(
      functools.partial(steps.train_step, graphdef, tx, jax.random.key(t.seed),
                        leaf_groups=leaf_groups if t.diagnostics else None,
                        skip_nonfinite=t.skip_nonfinite, accum_steps=t.get('grad_accum_steps', 1),
                        compute_dtype=t.get('compute_dtype', 'float32'),
                        loss_chunk=t.get('loss_chunk', 0)),
      donate_argnums=(0,), out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated))


def train_and_evaluate(config, workdir, hooks=()):
  """Trains `config` in `workdir`, resuming if a checkpoint exists. Returns the last train metrics.

  The host never waits for the device between log steps: steps are dispatched ahead, the next
  batch is placed while the current step runs, and the losses stay on the device until a log step
  or a save reads them. No checkpoint holds parameters from a non-finite step: a save first checks
  the device-side flag of the first such step.

  Args:
    config: a validated config (`training.validation.resolve` + `validate`).
    workdir: the run's directory (config.json, checkpoints/, metrics.jsonl, TensorBoard events).
    hooks: callables `hook(step, state)` run after every step, after its logging and evaluation
      and before the step's checkpoint and stop decision; e.g. a test that sends SIGTERM or raises
      at a chosen step. `state` is the training state pytree (reading it waits for the device).
  """
  paths.makedirs(workdir)  # local or gs:// (training.paths)
  lead = jax.process_index() == 0  # multi-process: only process 0 writes logs and reports
  with lock.WorkdirLock(workdir) if lead else contextlib.nullcontext():
    with checkpointing.quiet_background_errors():
      return _train(config, workdir, hooks, lead)


def _train(config, workdir, hooks, lead):
  """`train_and_evaluate` in a workdir this run holds."""
  for change in checkpointing.check_resume_config(workdir, config):
    if lead:
      print(f'train: resuming with changed {change}', file=sys.stderr)
  t = config.train
  tokenizer = pipeline.get_tokenizer(config.data)
  mesh = distributed.make_mesh(config)
  rules = sharding.rules_of(config.get('mesh', {}))
  graphdef, tx, state = state_lib.create_state(
      config, tokenizer.vocab_size, mesh, special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  # Rows first_row, ... of every global batch: all of it, or with data.shards and several
  # processes the shards of the rows this process's devices hold.
  it = pipeline.ShardedIterator(config.data, 'train', t.batch_size, config.data.get('shards', 1),
                                distributed.data_shards(config, mesh, rules),
                                arch=models.batch_format(config.model.arch), loss_on=t.loss_on,
                                seed=t.seed)
  mngr = checkpointing.checkpoint_manager(workdir, config)
  start, carried = 0, None
  restored = checkpointing.restore_newest_good(mngr, state, workdir) if mngr.all_steps() else None
  if restored is not None:
    state, data_state, start, carried = restored
    it.set_state(data_state)
    print(f'train: resumed from step {start} in {workdir}', file=sys.stderr)
  elif t.get('init_from'):
    # A fine-tune's step 0: another run's parameters, a fresh optimiser and schedule (a run with
    # checkpoints of its own resumed from them above instead).
    state, source_step = state_lib.init_from(state, t.init_from)
    print(f'train: parameters from {t.init_from} (its step {source_step}); starting at step 0',
          file=sys.stderr)
  if lead:  # atomically (other processes may be reading it); only now that the checkpoint
    # fits: a run refused at its resume leaves the config.json of the run that wrote the checkpoint
    paths.write_text(paths.join(workdir, 'config.json'), config.to_json_best_effort(indent=2))
  writer = writers.MetricsWriter(workdir, start) if lead else writers.NullWriter()

  # The parameter count per group goes to run_info.json (metrics.jsonl rows all carry a loss).
  groups, leaf_groups, group_sizes = diagnostics.param_groups(state['params'])
  info_path = paths.join(workdir, 'run_info.json')
  info = paths.read_json(info_path) if paths.exists(info_path) else {}
  info.update(num_params=sum(group_sizes.values()), params_by_group=group_sizes)
  if config.data.get('task') in text_corpus.TASKS:  # eval.py and a resume compare the files with it
    info.setdefault('corpus', text_corpus.fingerprint(text_corpus.spec_from_config(config.data)))
  if lead:
    writers.write_json(info_path, info)

  def in_mesh(fn):  # traced (on the first call) under the mesh (ring attention reads it) and
    def call(*args):  # with the activation sharding rules active
      with jax.set_mesh(mesh), sharding.use_rules(mesh, rules):
        return fn(*args)
    return call

  step_fn = in_mesh(jit_train_step(config, graphdef, tx, state, mesh, leaf_groups))

  def placed(fn):
    return lambda variables, batch: fn(variables, distributed.place_batch(batch, mesh, rules))
  diag_fn, eval_fn = (placed(in_mesh(jax.jit(functools.partial(fn, graphdef))))
                      for fn in (diagnostics.diagnostic_pass, steps.eval_step))
  schedule = state_lib.make_schedule(t)
  # Layers that redraw random features every R steps (the Performer; see redraw_features).
  model = nnx.merge(graphdef, *state_lib.model_variables(state))
  redraw_periods = {m.redraw_every for _, m in nnx.iter_modules(model)
                    if getattr(m, 'redraw_every', 0) > 0}
  del model
  window = empty_window()
  if carried:  # the sums of the resumed window's steps before the checkpoint: the row is whole
    window.update({k: jnp.asarray(carried[k], window[k].dtype) for k in WINDOW_KEYS})
  window_tokens, window_start = 0.0, time.perf_counter()
  last = {}
  bar = tqdm.tqdm(total=t.steps, initial=start, desc='train', mininterval=1.0, file=sys.stderr,
                  dynamic_ncols=True, disable=not lead)

  def check_finite(window):
    """Host side (waits for the device): stops the run at the first non-finite step, if any."""
    w = jax.device_get(window)
    bad = int(w['first_bad'])
    if bad:
      loss, grad_norm = float(w['bad_loss']), float(w['bad_grad_norm'])
      writer.write(bad, 'train', {'loss': loss})  # so that sweep comparisons see the divergence
      name, value = ('loss', loss) if not math.isfinite(loss) else ('grad_norm', grad_norm)
      good = mngr.latest_step()
      raise NonFiniteLoss(
          f'train: non-finite {name} ({value}) at step {bad}; stopping. ' +
          (f'The last good checkpoint is step {good} in {workdir}' if good is not None else
           'No checkpoint was saved before it') +
          ' (train.skip_nonfinite=True skips such steps instead)')
    return w

  saves = {'good': start or None, 'pending': None}  # the newest confirmed step, the one in flight

  def save(step, window):
    w = check_finite(window)
    checkpointing.confirm_saved(mngr, workdir)  # the previous save's outcome, before the next
    saves['good'] = saves['pending'] or saves['good']
    # Process 0 writes the data position: every shard's, gathered from the processes reading them.
    data_state = pipeline.ShardedIterator.merge_states(distributed.allgather_json(data_position))
    writer.flush()  # object storage: the rows up to this checkpoint are durable before it
    try:
      mngr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
          window=ocp.args.JsonSave({k: w[k].item() for k in WINDOW_KEYS})))
    except Exception as e:  # pylint: disable=broad-except  # orbax/tensorstore raise many kinds
      raise checkpointing.save_failed(mngr, workdir, e) from None
    saves['pending'] = step

  signals = StopSignals()
  profiler = Profiler(t.get('profile_steps', ''), workdir)
  batches = prefetched(it, lambda b: distributed.place_batch(b, mesh, rules, it.first_row,
                                                             t.batch_size))
  failing = True  # until the loop ends normally
  try:
    for step in range(start + 1, t.steps + 1):
      batch, data_position, device_batch = next(batches)
      # Features due at this step are drawn before it, so that a checkpoint or evaluation after
      # step s holds the draw step s trained with.
      if step > 1 and any((step - 1) % r == 0 for r in redraw_periods):
        state = state_lib.redraw_features(graphdef, state, step - 1)
      profiler.before(step)
      state, sums = step_fn(state, device_batch)
      diag = sums.pop('diag', None)  # per-group [G] norms, read at log steps only
      window = accumulate(window, sums, step)
      if step == 1 and diag is not None and lead:
        # Step 1's gradient is taken at the initial parameters (Xiong et al. 2020, Figure 3).
        grad = np.sqrt(np.asarray(jax.device_get(diag['grad_sq']), np.float64))
        writers.write_json(paths.join(workdir, 'init_grad_norms.json'), {
            'grad_norm': float(np.sqrt(np.sum(np.square(grad)))),
            'groups': dict(zip(groups, map(float, grad))),
            'blocks': [float(v) for n, v in zip(groups, grad) if '/blocks/' in f'/{n}'],
            'norm_position': config.model.norm_position, 'num_layers': config.model.num_layers})
      if 'unigram_entropy' not in info:  # the level compare's plateau rule uses
        info['unigram_entropy'] = diagnostics.unigram_entropy(
            distributed.global_batch(batch, it.first_row, t.batch_size))
        if lead:
          writers.write_json(info_path, info)
      # This process's rows, scaled to the global batch where it reads only some.
      window_tokens += steps.count_tokens(batch) * t.batch_size / len(next(iter(batch.values())))
      bar.update(1)
      profiler.after(step, state)
      if step % t.log_every == 0 or step == t.steps:
        w = check_finite(window)  # the one wait for the device between log steps
        elapsed = time.perf_counter() - window_start
        last = steps.finalize({k: w[k] for k in ('loss_sum', 'correct_sum', 'weight_sum')})
        last['grad_norm'] = float(w['grad_norm']) / max(int(w['steps']), 1)
        last['param_norm'] = float(w['param_norm'])
        last['learning_rate'] = float(schedule(step - 1))
        last['tokens_per_sec'] = window_tokens / elapsed
        if t.skip_nonfinite:
          last['skipped_steps'] = int(state['skipped'])
        if diag is not None:  # the log step's values (not window means)
          last.update(diagnostics.diagnostic_metrics(groups, diag))
          rows = t.diagnostics_batch or t.batch_size
          whole = distributed.global_batch(batch, it.first_row, t.batch_size)
          last.update({k: float(v) for k, v in diag_fn(
              state_lib.model_variables(state), jax.tree.map(lambda a: a[:rows], whole)).items()})
        writer.write(step, 'train', last)
        bar.set_postfix(loss=f'{last["loss"]:.3f}', tok_s=f'{last["tokens_per_sec"]:.0f}')
        window, window_tokens, window_start = empty_window(), 0.0, time.perf_counter()
      if step % t.eval_every == 0 or step == t.steps:
        writer.write(step, 'valid', evaluation.evaluate(
            eval_fn, state_lib.model_variables(state), config, 'validation', t.eval_batches))
      for hook in hooks:
        hook(step, state)  # a signal a hook sends is handled before the next line
      stop = signals.stop_after(step)
      if step % t.checkpoint_every == 0 or step == t.steps or stop:
        save(step, window)
      if stop:
        checkpointing.confirm_saved(mngr, workdir)
        raise Stopped(stop, step)
    checkpointing.confirm_saved(mngr, workdir)  # the last save's outcome: a failure exits 1
    failing = False
  except Exception as e:  # pylint: disable=broad-except
    if not (paths.is_remote(workdir) and paths.is_storage_error(e)):
      raise
    raise store_lost(e, saves['good'], workdir) from None
  finally:
    profiler.stop(state)
    signals.restore()
    bar.close()
    try:
      mngr.wait_until_finished()
      mngr.close()
    except Exception:  # pylint: disable=broad-except  # reported by confirm_saved, or superseded
      pass
    try:
      writer.close()  # flushes TensorBoard's events: a full disk fails here too
    except Exception as e:  # pylint: disable=broad-except  # OSError, or the store's own errors
      if not failing:  # after a failed save, say, that failure's one line says it all
        print(f'train: closing the logs in {workdir} failed ({e.strerror or e}); metrics.jsonl '
              'holds every row written before', file=sys.stderr)
  return last
