"""training.loop: steps dispatched ahead of the device, a profiler trace of chosen steps, and log
rows after a resume equal to an uninterrupted run's."""

import gzip
import json
import os

import numpy as np
import pytest

from tests.helpers import interrupt_after, metric_rows, quick_config
from training import loop


def test_steps_are_dispatched_ahead_of_the_device(data_dir, tmp_path):
  """Between log steps the host never waits: after dispatching a step, the loop reaches the hooks
  while the device is still computing it (a loop that read the loss every step, as before, would
  always find the step done)."""
  config = quick_config(data_dir, steps=24, log_every=12, eval_every=1000, checkpoint_every=1000,
                        diagnostics=False, batch_size=32)
  config.model.update(d_model=128, d_ff=512, num_layers=3)
  pending = []

  def hook(step, state):
    if step % 12:  # not a log step
      pending.append(not state['step'].is_ready())

  loop.train_and_evaluate(config, str(tmp_path), hooks=[hook])
  assert len(pending) == 22
  assert sum(pending) >= 11, pending  # most steps were still running when the hook saw them


def test_profile_steps_write_a_trace_that_opens(data_dir, tmp_path):
  config = quick_config(data_dir, steps=6, log_every=6, eval_every=1000, checkpoint_every=1000,
                        warmup_steps=0)
  config.train.profile_steps = '2,3'
  loop.train_and_evaluate(config, str(tmp_path))
  traces = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / 'profile') for f in fs
            if f == 'perfetto_trace.json.gz']
  assert len(traces) == 1
  with gzip.open(traces[0]) as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  names = {e.get('name', '') for e in events}
  assert len(events) > 10 and any('jit' in n or 'train_step' in n for n in names), (
      sorted(names)[:20])


@pytest.mark.parametrize('log_every', [4])
def test_a_resumed_run_logs_the_uninterrupted_rows(data_dir, tmp_path, log_every):
  """Checkpoint at 10 (inside the window 9-12), killed after 11: the resumed run's row at step 12
  averages steps 9-12 like the uninterrupted run's (the window's sums are in the checkpoint)."""
  config = quick_config(data_dir, steps=16, log_every=log_every, checkpoint_every=5,
                        eval_every=1000)
  loop.train_and_evaluate(config, str(tmp_path / 'full'))
  with pytest.raises(KeyboardInterrupt):
    loop.train_and_evaluate(config, str(tmp_path / 'cut'), hooks=[interrupt_after(11)])
  loop.train_and_evaluate(config, str(tmp_path / 'cut'))
  keys = ('step', 'loss', 'accuracy', 'grad_norm', 'param_norm', 'learning_rate')
  full, cut = metric_rows(tmp_path / 'full'), metric_rows(tmp_path / 'cut')
  assert [r['step'] for r in cut] == [4, 8, 12, 16]
  np.testing.assert_allclose([[r[k] for k in keys] for r in cut],
                             [[r[k] for k in keys] for r in full], rtol=1e-6)
