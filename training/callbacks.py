"""The parts of the training loop that act around its steps: logging, evaluation, the init-gradient
record, the profiler, feature redraws, checkpoint and stop, and user hooks.

`training.loop` is the core: it runs the steps and calls each `Callback` before and after every
step; a callback with `every=N` acts after steps N, 2N, ... and after the last one (the manner of
flax's periodic actions and Levanter's hooks). Users and tests add their own through
`train_and_evaluate(config, workdir, hooks=[...])`: a `Callback`, or a plain `hook(step, state)`.
"""

import math
import signal
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import tqdm

from data import pipeline
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


class NonFiniteLoss(checkpointing.RunFailed):
  """The loss or the gradient became NaN or inf."""


class Stopped(Exception):
  """SIGTERM/SIGINT: the run saved a checkpoint at the current step and stopped."""

  def __init__(self, signum, step):
    super().__init__(f'train: stopped by {signal.Signals(signum).name} after step {step}; '
                     'checkpoint saved, rerun the same command to resume')
    self.signum = signum


class Callback:
  """One part of the loop. Override any of the methods; each receives the `Run`.

  Attributes:
    every: N > 0: `at_step` runs after steps N, 2N, ... and the run's last step; 0: after every
      step.
  """

  every = 0

  def start(self, run):
    """Once, after the state is built or restored, before the first step."""

  def before_step(self, step, run):
    """Before step `step` is dispatched (`run.state` is the state after step - 1)."""

  def due(self, step, run):
    """Whether `at_step` runs after `step`."""
    return not self.every or step % self.every == 0 or step == run.last_step

  def after_step(self, step, run):
    """After every step; calls `at_step` when the callback is due."""
    if self.due(step, run):
      self.at_step(step, run)

  def at_step(self, step, run):
    """After the steps this callback is due at."""

  def close(self, run):
    """Once when the loop ends, normally or not (in its `finally`)."""


class Hook(Callback):
  """A plain `hook(step, state)` run after every step, after logging and evaluation and before the
  step's checkpoint and stop decision (e.g. a test that sends SIGTERM at a chosen step). Reading
  `state` waits for the device."""

  def __init__(self, fn, every=0):
    self.fn, self.every = fn, every

  def at_step(self, step, run):
    self.fn(step, run.state)


class Run:
  """What the callbacks share: the config, the state after the latest step, the host batch and the
  device-side log sums, the writers and the checkpoint manager (attributes set by training.loop)."""

  def __init__(self, **fields):
    self.stop = 0  # the signal to stop after the current step with (0: go on)
    self.last = {}  # the newest train row
    self.__dict__.update(fields)

  def check_finite(self):
    """Host side (waits for the device): the log sums, or NonFiniteLoss at the first non-finite
    step since the last log row."""
    w = jax.device_get(self.log_sums)
    bad = int(w['first_bad'])
    if bad:
      loss, grad_norm = float(w['bad_loss']), float(w['bad_grad_norm'])
      self.writer.write(bad, 'train', {'loss': loss})  # so that sweep comparisons see it
      name, value = ('loss', loss) if not math.isfinite(loss) else ('grad_norm', grad_norm)
      good = self.mngr.latest_step()
      raise NonFiniteLoss(
          f'train: non-finite {name} ({value}) at step {bad}; stopping. ' +
          (f'The last good checkpoint is step {good} in {self.workdir}' if good is not None else
           'No checkpoint was saved before it') +
          ' (train.skip_nonfinite=True skips such steps instead)')
    return w


class FeatureRedraw(Callback):
  """Layers that redraw random features every R steps (the Performer): the draw due at a step is
  made before it, so a checkpoint or evaluation after step s holds the draw step s trained with."""

  def __init__(self, periods):
    self.periods = periods

  def before_step(self, step, run):
    if step > 1 and any((step - 1) % r == 0 for r in self.periods):
      run.state = state_lib.redraw_features(run.graphdef, run.state, step - 1)


class ProfilerCallback(Callback):
  """`train.profile_steps`: the trace of `profiler` (a `training.loop.Profiler`) around
  its steps."""

  def __init__(self, profiler):
    self.profiler = profiler

  def before_step(self, step, run):
    self.profiler.before(step)

  def after_step(self, step, run):
    self.profiler.after(step, run.state)

  def close(self, run):
    self.profiler.stop(run.state)


class InitGradients(Callback):
  """With train.diagnostics: step 1's per-group gradient norms, taken at the initial parameters
  (Xiong et al. 2020, Figure 3), in init_grad_norms.json."""

  def at_step(self, step, run):
    if step != 1 or run.diag is None or not run.lead:
      return
    grad = np.sqrt(np.asarray(jax.device_get(run.diag['grad_sq']), np.float64))
    m = run.config.model
    writers.write_json(paths.join(run.workdir, 'init_grad_norms.json'), {
        'grad_norm': float(np.sqrt(np.sum(np.square(grad)))),
        'groups': dict(zip(run.groups, map(float, grad))),
        'blocks': [float(v) for n, v in zip(run.groups, grad) if '/blocks/' in f'/{n}'],
        'norm_position': m.norm_position, 'num_layers': m.num_layers})


class UnigramEntropy(Callback):
  """The first batch's unigram entropy in run_info.json: the level tools.compare's plateau rule
  uses."""

  def at_step(self, step, run):
    if 'unigram_entropy' in run.info:
      return
    t = run.config.train
    run.info['unigram_entropy'] = diagnostics.unigram_entropy(
        distributed.global_batch(run.batch, run.it.first_row, t.batch_size))
    if run.lead:
      writers.write_json(run.info_path, run.info)


class Logger(Callback):
  """Every `train.log_every` steps: one train row (loss, accuracy, norms, learning rate, tokens/s,
  the MoE terms and the z-loss when on, and the diagnostics at that step) in metrics.jsonl and
  TensorBoard; a progress bar meanwhile."""

  def __init__(self, config, start, lead):
    t = self.t = config.train
    self.every = t.log_every
    self.moe = config.model.get('moe_experts', 0) > 0
    self.z_loss = config.train.get('z_loss', 0.0) > 0
    self.schedule = state_lib.make_schedule(t)
    self.bar = tqdm.tqdm(total=t.steps, initial=start, desc='train', mininterval=1.0,
                         file=sys.stderr, dynamic_ncols=True, disable=not lead)
    self.tokens, self.since = 0.0, time.perf_counter()

  def after_step(self, step, run):
    # This process's rows, scaled to the global batch where it reads only some.
    batch = run.batch
    self.tokens += steps.count_tokens(batch) * self.t.batch_size / len(next(iter(batch.values())))
    self.bar.update(1)
    super().after_step(step, run)

  def at_step(self, step, run):
    t = self.t
    w = run.check_finite()  # the one wait for the device between log steps
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
      last['skipped_steps'] = int(run.state['skipped'])
    if run.diag is not None:  # the log step's values (not window means)
      last.update(diagnostics.diagnostic_metrics(run.groups, run.diag))
      rows = t.diagnostics_batch or t.batch_size
      whole = distributed.global_batch(run.batch, run.it.first_row, t.batch_size)
      last.update({k: float(v) for k, v in run.diag_fn(
          state_lib.model_variables(run.state), jax.tree.map(lambda a: a[:rows], whole)).items()})
    run.writer.write(step, 'train', last)
    self.bar.set_postfix(loss=f'{last["loss"]:.3f}', tok_s=f'{last["tokens_per_sec"]:.0f}')
    run.last = last
    run.reset_log_sums()
    self.tokens, self.since = 0.0, time.perf_counter()

  def close(self, run):
    self.bar.close()


class Evaluator(Callback):
  """Every `train.eval_every` steps: the validation loss over `train.eval_batches` batches."""

  def __init__(self, config):
    self.every = config.train.eval_every

  def at_step(self, step, run):
    t = run.config.train
    run.writer.write(step, 'valid', evaluation.evaluate(
        run.eval_fn, state_lib.model_variables(run.state), run.config, 'validation',
        t.eval_batches))


class Checkpointer(Callback):
  """Every `train.checkpoint_every` steps, at the last step and when a stop signal arrived: a
  checkpoint (state, data position, log sums), after the non-finite check; then the stop itself.
  Runs last, so that everything a step logs is in before its checkpoint."""

  def __init__(self, config, signals):
    self.every = config.train.checkpoint_every
    self.signals = signals  # a training.loop.StopSignals

  def after_step(self, step, run):
    run.stop = self.signals.stop_after(step)
    if self.due(step, run) or run.stop:
      self.at_step(step, run)
    if run.stop:
      checkpointing.confirm_saved(run.mngr, run.workdir)
      raise Stopped(run.stop, step)

  def at_step(self, step, run):
    w = run.check_finite()
    checkpointing.confirm_saved(run.mngr, run.workdir)  # the previous save's outcome first
    run.saves['good'] = run.saves['pending'] or run.saves['good']
    # Process 0 writes the data position: every shard's, gathered from the processes reading them.
    data_state = pipeline.ShardedIterator.merge_states(
        distributed.allgather_json(run.data_position))
    run.writer.flush()  # object storage: the rows up to this checkpoint are durable before it
    try:
      run.mngr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(run.state), data=ocp.args.JsonSave(data_state),
          window=ocp.args.JsonSave({k: w[k].item() for k in LOG_SUM_KEYS + steps.MOE_METRICS})))
    except Exception as e:  # noqa: BLE001
      raise checkpointing.save_failed(run.mngr, run.workdir, e) from None
    run.saves['pending'] = step

  def close(self, run):
    self.signals.restore()
