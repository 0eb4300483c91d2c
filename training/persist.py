"""The loop's persist phase: the checkpoint of a step and the decision to stop after it
(`Checkpointer`), on the stop signals of every process (`StopSignals`)."""

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from data import pipeline
from training import callbacks
from training import checkpointing
from training import distributed
from training import steps
from training import supervisor


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


class Checkpointer(callbacks.Callback):
  """Every `train.checkpoint_every` steps, at the last step and when a stop signal arrived (or an
  observe callback asked to stop): a checkpoint (state, data position, log sums), after the
  non-finite check; then the stop itself (`Action.stop`). A PERSIST callback: everything a step
  logs is in before its checkpoint.

  Attributes:
    good: the newest step whose save was confirmed (None: none), named when the store is lost.
  """

  phase = callbacks.PERSIST

  def __init__(self, config, signals, start):
    self.every = config.train.checkpoint_every
    self.signals = signals  # a StopSignals
    self.good, self.pending = start or None, None  # the newest confirmed step, the one in flight
    supervisor.note_checkpoint(self.good)  # named if a process of the run is lost

  def after_step(self, step, record):
    # Asked every step: with several processes it is the preemption service's sync point.
    stop = self.signals.stop_after(step) or record.stop
    if self.due(step, record) or stop:
      failed = self.at_step(step, record)
      if failed:
        return failed
    if stop:
      try:
        checkpointing.confirm_saved(record.run.mngr, record.run.workdir)
      except checkpointing.RunFailed as e:
        return callbacks.Action(fail=e)
      return callbacks.Action(stop=stop)
    return None

  def at_step(self, step, record):
    """Saves `step` (asynchronously); an `Action` that fails the run if it cannot."""
    run = record.run
    w, failure = callbacks.finite_window(record)
    if failure:
      return callbacks.Action(fail=failure)
    try:
      checkpointing.confirm_saved(run.mngr, run.workdir)  # the previous save's outcome first
    except checkpointing.RunFailed as e:
      return callbacks.Action(fail=e)
    self.good = self.pending or self.good
    supervisor.note_checkpoint(self.pending)
    # Process 0 writes the data position: every shard's, gathered from the processes reading them.
    data_state = pipeline.ShardedIterator.merge_states(
        distributed.allgather_json(record.data_position))
    run.writer.flush()  # object storage: the rows up to this checkpoint are durable before it
    try:
      run.mngr.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(record.state), data=ocp.args.JsonSave(data_state),
          window=ocp.args.JsonSave({k: w[k].item()
                                    for k in callbacks.LOG_SUM_KEYS + steps.MOE_METRICS})))
    except Exception as e:  # noqa: BLE001
      return callbacks.Action(fail=checkpointing.save_failed(run.mngr, run.workdir, e))
    self.pending = step
    return None

  def close(self, record):
    self.signals.restore()
