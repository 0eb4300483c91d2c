"""The parts of the training loop that act around its steps: logging, evaluation, the init-gradient
record, the profiler, feature redraws and user hooks (the checkpoint and stop: `training.persist`).

`training.loop` is the core: it builds the run's frozen `RunContext`, runs the steps, and calls
each `Callback` before and after every step with an immutable `StepRecord`; a callback with
`every=N` acts after steps N, 2N, ... and after the last one (the manner of flax's periodic actions
and Levanter's hooks). A callback never changes the run: it returns an `Action` (replace the state,
a train row written, stop, fail) that the loop applies before the next callback runs. Callbacks run
by phase, all `OBSERVE` ones (in the order given), then the `PERSIST` ones, so a step's rows are
written before its checkpoint. Users and tests add their own through
`train_and_evaluate(config, workdir, hooks=[...])`: a `Callback`, or a plain `hook(step, state)`.
"""

import dataclasses
import math
import signal
import sys
import time
import types
from typing import Any, Callable, Mapping

import jax
import numpy as np
import tqdm

from training import checkpointing
from training import diagnostics
from training import distributed
from training import evaluation
from training import paths
from training import state as state_lib
from training import steps
from training import writers

# The log sums a checkpoint keeps (its item is called 'window' on disk: the log window).
LOG_SUM_KEYS = ('loss_sum', 'correct_sum', 'weight_sum', 'grad_norm', 'steps', steps.Z_LOSS_SUM)

# The phases of a step's callbacks, in the order the loop runs them: what reads the step (logs,
# evaluation, user hooks), then what keeps it (the checkpoint and the stop decision).
OBSERVE, PERSIST = 'observe', 'persist'
PHASES = (OBSERVE, PERSIST)


class NonFiniteLoss(checkpointing.RunFailed):
  """The loss or the gradient became NaN or inf."""


class Stopped(Exception):
  """SIGTERM/SIGINT: the run saved a checkpoint at the current step and stopped."""

  def __init__(self, signum, step):
    super().__init__(f'train: stopped by {signal.Signals(signum).name} after step {step}; '
                     'checkpoint saved, rerun the same command to resume')
    self.signum = signum


@dataclasses.dataclass(frozen=True)
class RunContext:
  """What a run holds fixed from set-up to the end (built by `training.loop`; read-only).

  Attributes:
    config, workdir, lead: the validated config, the run's directory, whether this process writes
      the logs (process 0).
    mesh, rules: the device mesh and the activation sharding rules.
    graphdef: the model's graph (`nnx.split`), merged with a state's variables.
    it: the train data iterator (`data.pipeline.ShardedIterator`), read by the loop.
    mngr, writer: the Orbax checkpoint manager, the metrics writer (NullWriter off process 0).
    start: the step the run starts after (0, or the restored checkpoint's).
    groups, leaf_groups: the parameter groups' names and every leaf's group index
      (`diagnostics.param_groups`): the jitted step's per-group norms.
    info_path, info: run_info.json and what set-up wrote into it.
    redraw_periods: the random-feature layers' redraw periods R (the Performer).
    step_fn, diag_fn, eval_fn: the jitted train step (state donated), diagnostic pass and eval step.
  """

  config: Any
  workdir: str
  lead: bool
  mesh: Any
  rules: Any
  graphdef: Any
  it: Any
  mngr: Any
  writer: Any
  start: int
  groups: tuple
  leaf_groups: Any
  info_path: str
  info: Mapping[str, Any]
  redraw_periods: frozenset
  step_fn: Callable
  diag_fn: Callable
  eval_fn: Callable

  def __post_init__(self):
    object.__setattr__(self, 'info', types.MappingProxyType(dict(self.info)))

  @property
  def last_step(self):
    return self.config.train.steps


@dataclasses.dataclass(frozen=True)
class StepRecord:
  """What a callback sees of one step (the loop makes a new record; nothing here is changed).

  Attributes:
    run: the run's `RunContext`.
    step: the step this record is about: in `before_step` the one about to be dispatched (`state`
      is then the state after step - 1), in `after_step` the one just dispatched.
    state: the training state pytree (reading it waits for the device; the next step donates it).
    log_sums: the device-side sums of the log window so far (`training.loop.empty_log_sums`).
    batch, data_position: the step's host batch and the data iterator's state as of it.
    diag: the step's per-group `[G]` squared norms (train.diagnostics), else None.
    last: the newest train row (the loss, accuracy, ... of the latest log step).
    stop: the signal a callback before asked to stop after this step with (0: go on).
  """

  run: RunContext
  step: int
  state: Any
  log_sums: Any
  batch: Any = None
  data_position: Any = None
  diag: Any = None
  last: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  stop: int = 0


@dataclasses.dataclass(frozen=True)
class Action:
  """What a callback asks the loop to do (a callback returns one, or None: go on).

  Attributes:
    state: replace the training state with this one (in `before_step`: the step trains on it).
    row: a train row was written: it becomes the run's newest, and the log window starts anew.
    stop: a signal number: end the run after this step's callbacks with `Stopped` (exit status
      128 + the signal); the persist phase saves the step first (on several processes, every
      process must ask at the same step).
    fail: end the run now with this error (a `checkpointing.RunFailed`: one line, exit 1).
  """

  state: Any = None
  row: Mapping[str, Any] = None
  stop: int = 0
  fail: Exception = None


def by_phase(callbacks):
  """`callbacks` in the order the loop runs them: every OBSERVE one, then every PERSIST one (each
  phase in the order given)."""
  unknown = [cb for cb in callbacks if cb.phase not in PHASES]
  if unknown:
    raise ValueError(f'callback {type(unknown[0]).__name__} has phase {unknown[0].phase!r}; '
                     f'valid: {", ".join(PHASES)}')
  return [cb for phase in PHASES for cb in callbacks if cb.phase == phase]


def finite_window(record):
  """Host side (waits for the device): (the log sums, None), or (None, NonFiniteLoss) at the first
  non-finite step since the last log row (whose loss is written as a row first)."""
  run = record.run
  w = jax.device_get(record.log_sums)
  bad = int(w['first_bad'])
  if not bad:
    return w, None
  loss, grad_norm = float(w['bad_loss']), float(w['bad_grad_norm'])
  run.writer.write(bad, 'train', {'loss': loss})  # so that sweep comparisons see it
  name, value = ('loss', loss) if not math.isfinite(loss) else ('grad_norm', grad_norm)
  good = run.mngr.latest_step()
  return None, NonFiniteLoss(
      f'train: non-finite {name} ({value}) at step {bad}; stopping. ' +
      (f'The last good checkpoint is step {good} in {run.workdir}' if good is not None else
       'No checkpoint was saved before it') +
      ' (train.skip_nonfinite=True skips such steps instead)')


class Callback:
  """One part of the loop. Override any of the methods; each receives the step's `StepRecord` and
  may return an `Action` (None: nothing to do).

  Attributes:
    every: N > 0: `at_step` runs after steps N, 2N, ... and the run's last step; 0: after every
      step.
    phase: OBSERVE (the default: logs, evaluation, hooks) or PERSIST (after every OBSERVE one).
  """

  every = 0
  phase = OBSERVE

  def start(self, record):
    """Once, after the state is built or restored, before the first step (`record.step`: the
    step the run starts after)."""

  def before_step(self, step, record):
    """Before step `step` is dispatched (`record.state` is the state after step - 1)."""

  def due(self, step, record):
    """Whether `at_step` runs after `step`."""
    return not self.every or step % self.every == 0 or step == record.run.last_step

  def after_step(self, step, record):
    """After every step; calls `at_step` when the callback is due."""
    if self.due(step, record):
      return self.at_step(step, record)
    return None

  def at_step(self, step, record):
    """After the steps this callback is due at."""

  def close(self, record):
    """Once when the loop ends, normally or not (in its `finally`), with the newest record."""


class Hook(Callback):
  """A plain `hook(step, state)` run after every step, after logging and evaluation and before the
  step's checkpoint and stop decision (e.g. a test that sends SIGTERM at a chosen step). Reading
  `state` waits for the device."""

  def __init__(self, fn, every=0):
    self.fn, self.every = fn, every

  def at_step(self, step, record):
    self.fn(step, record.state)


class FeatureRedraw(Callback):
  """Layers that redraw random features every R steps (the Performer): the draw due at a step is
  made before it, so a checkpoint or evaluation after step s holds the draw step s trained with."""

  def __init__(self, periods):
    self.periods = periods

  def before_step(self, step, record):
    if step > 1 and any((step - 1) % r == 0 for r in self.periods):
      return Action(state=state_lib.redraw_features(record.run.graphdef, record.state, step - 1))
    return None


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


class ProfilerCallback(Callback):
  """`train.profile_steps`: the trace of `profiler` (a `Profiler`) around its steps."""

  def __init__(self, profiler):
    self.profiler = profiler

  def before_step(self, step, record):
    self.profiler.before(step)

  def after_step(self, step, record):
    self.profiler.after(step, record.state)

  def close(self, record):
    self.profiler.stop(record.state)


class InitGradients(Callback):
  """With train.diagnostics: step 1's per-group gradient norms, taken at the initial parameters
  (Xiong et al. 2020, Figure 3), in init_grad_norms.json."""

  def at_step(self, step, record):
    run = record.run
    if step != 1 or record.diag is None or not run.lead:
      return
    grad = np.sqrt(np.asarray(jax.device_get(record.diag['grad_sq']), np.float64))
    m = run.config.model
    writers.write_json(paths.join(run.workdir, 'init_grad_norms.json'), {
        'grad_norm': float(np.sqrt(np.sum(np.square(grad)))),
        'groups': dict(zip(run.groups, map(float, grad))),
        'blocks': [float(v) for n, v in zip(run.groups, grad) if '/blocks/' in f'/{n}'],
        'norm_position': m.norm_position, 'num_layers': m.num_layers})


class UnigramEntropy(Callback):
  """The first batch's unigram entropy in run_info.json: the level tools.compare's plateau rule
  uses."""

  done = False

  def at_step(self, step, record):
    if self.done or 'unigram_entropy' in record.run.info:  # a resumed run measured it already
      return
    run, t = record.run, record.run.config.train
    info = {**run.info, 'unigram_entropy': diagnostics.unigram_entropy(
        distributed.global_batch(record.batch, run.it.first_row, t.batch_size))}
    if run.lead:
      writers.write_json(run.info_path, info)
    self.done = True


class Logger(Callback):
  """Every `train.log_every` steps: one train row (loss, accuracy, norms, learning rate, tokens/s,
  the MoE terms and the z-loss when on, and the diagnostics at that step) in metrics.jsonl and
  TensorBoard; a progress bar meanwhile. Returns the row (`Action.row`): the window starts anew."""

  def __init__(self, config, start, lead):
    t = self.t = config.train
    self.every = t.log_every
    self.moe = config.model.get('moe_experts', 0) > 0
    self.z_loss = config.train.get('z_loss', 0.0) > 0
    self.schedule = state_lib.make_schedule(t)
    self.bar = tqdm.tqdm(total=t.steps, initial=start, desc='train', mininterval=1.0,
                         file=sys.stderr, dynamic_ncols=True, disable=not lead)
    self.tokens, self.since = 0.0, time.perf_counter()

  def after_step(self, step, record):
    # This process's rows, scaled to the global batch where it reads only some.
    batch = record.batch
    self.tokens += steps.count_tokens(batch) * self.t.batch_size / len(next(iter(batch.values())))
    self.bar.update(1)
    return super().after_step(step, record)

  def at_step(self, step, record):
    w, failure = finite_window(record)  # the one wait for the device between log steps
    if failure:
      return Action(fail=failure)
    last = self._row(step, record, w)
    record.run.writer.write(step, 'train', last)
    self.bar.set_postfix(loss=f'{last["loss"]:.3f}', tok_s=f'{last["tokens_per_sec"]:.0f}')
    self.tokens, self.since = 0.0, time.perf_counter()
    return Action(row=last)

  def _row(self, step, record, w):
    """The train row of the window `w` (host-side log sums) ending at `step`."""
    t, run = self.t, record.run
    last = steps.finalize({k: w[k] for k in ('loss_sum', 'correct_sum', 'weight_sum')})
    last['grad_norm'] = float(w['grad_norm']) / max(int(w['steps']), 1)
    last['param_norm'] = float(w['param_norm'])
    if self.moe:  # means over the window's steps, like the loss (layers.moe.MoE's terms)
      last.update({k: float(w[k]) / max(int(w['steps']), 1) for k in steps.MOE_METRICS})
    if self.z_loss:  # the mean (log Z)² per token of weight, unscaled by train.z_loss
      last['z_loss'] = float(w[steps.Z_LOSS_SUM]) / max(float(w['weight_sum']), 1.0)
    last['learning_rate'] = float(self.schedule(step - 1))
    last['tokens_per_sec'] = self.tokens / (time.perf_counter() - self.since)
    if t.skip_nonfinite:
      last['skipped_steps'] = int(record.state['skipped'])
    if record.diag is not None:  # the log step's values (not window means)
      last.update(diagnostics.diagnostic_metrics(run.groups, record.diag))
      rows = t.diagnostics_batch or t.batch_size
      whole = distributed.global_batch(record.batch, run.it.first_row, t.batch_size)
      last.update({k: float(v) for k, v in run.diag_fn(
          state_lib.model_variables(record.state),
          jax.tree.map(lambda a: a[:rows], whole)).items()})
    return last

  def close(self, record):
    self.bar.close()


class Evaluator(Callback):
  """Every `train.eval_every` steps: the validation loss over `train.eval_batches` batches."""

  def __init__(self, config):
    self.every = config.train.eval_every

  def at_step(self, step, record):
    run = record.run
    run.writer.write(step, 'valid', evaluation.evaluate(
        run.eval_fn, state_lib.model_variables(record.state), run.config, 'validation',
        run.config.train.eval_batches))
