"""Faults that once hung a run or left a state only a hand edit could mend: each ends in one line,
and the same command then resumes to the uninterrupted run's metrics, row for row."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, quick_config
from training import checkpointing
from training import loop
from training import writers

KEYS = ('step', 'split', 'loss', 'accuracy', 'grad_norm', 'param_norm', 'learning_rate')


def small(data_dir, **train):
  # A constant rate: a run of 4 steps continued to 6 is then the run of 6 (a schedule would
  # depend on the step count).
  return quick_config(data_dir, **{'steps': 4, 'checkpoint_every': 2, 'log_every': 1,
                                   'eval_every': 2, 'warmup_steps': 0, 'schedule': 'constant',
                                   **train})


def rows(workdir):
  return [tuple(r.get(k) for k in KEYS)
          for r in writers.read_metrics(os.path.join(workdir, 'metrics.jsonl'))]


@pytest.fixture(scope='module')
def uninterrupted(data_dir, tmp_path_factory):
  """The rows of 6 uninterrupted steps, the record every repaired run must end with."""
  workdir = tmp_path_factory.mktemp('full')
  loop.train_and_evaluate(small(data_dir, steps=6), str(workdir))
  return rows(workdir)


def train_cli(workdir, data_dir, steps, *extra):
  return subprocess.run(
      [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
       f'--workdir={workdir}', f'--config.data.data_dir={data_dir}',
       f'--config.train.steps={steps}',
       '--config.train.checkpoint_every=2', '--config.train.log_every=1',
       '--config.train.eval_every=2', '--config.train.warmup_steps=0',
       '--config.train.schedule=constant', *extra],
      cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_checkpoints_that_is_a_file_is_refused_at_once_not_a_hang(data_dir, tmp_path,
                                                                   uninterrupted):
  (tmp_path / 'checkpoints').write_text('x')
  out = train_cli(tmp_path, data_dir, 6)  # the timeout fails the test if it hangs
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and 'checkpoints is a file' in lines[0], out.stderr[-2000:]
  assert sorted(os.listdir(tmp_path)) == ['checkpoints']  # nothing written
  os.remove(tmp_path / 'checkpoints')  # the repair the line asks for
  assert train_cli(tmp_path, data_dir, 6).returncode == 0
  assert rows(tmp_path) == uninterrupted


def test_a_refused_resume_writes_nothing_that_outlives_it(data_dir, tmp_path, uninterrupted):
  loop.train_and_evaluate(small(data_dir), str(tmp_path))
  os.remove(tmp_path / 'config.json')
  other = small(data_dir, steps=6)
  other.model.update(d_model=64, d_ff=128)
  with pytest.raises(checkpointing.IncompatibleResume, match='holds arrays of other shapes'):
    loop.train_and_evaluate(other, str(tmp_path))
  assert not (tmp_path / 'config.json').exists()  # the refused values were not recorded
  loop.train_and_evaluate(small(data_dir, steps=6), str(tmp_path))  # the original command
  assert rows(tmp_path) == uninterrupted


def test_a_damaged_window_item_falls_back_to_the_previous_step(data_dir, tmp_path,
                                                               uninterrupted, capfd):
  loop.train_and_evaluate(small(data_dir), str(tmp_path))
  (tmp_path / 'checkpoints' / '4' / 'window' / 'metadata').write_text('[1, 2')
  loop.train_and_evaluate(small(data_dir, steps=6), str(tmp_path))
  assert 'checkpoint step 4' in capfd.readouterr().err
  assert rows(tmp_path) == uninterrupted


def test_an_unparsable_config_json_is_set_aside_with_one_line(data_dir, tmp_path, uninterrupted):
  assert train_cli(tmp_path, data_dir, 4).returncode == 0
  (tmp_path / 'config.json').write_text('{"model": ')
  out = subprocess.run([sys.executable, 'eval.py', f'--workdir={tmp_path}', '--split=test'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and 'config.json is damaged' in lines[0], out.stderr[-2000:]
  out = train_cli(tmp_path, data_dir, 6)
  assert out.returncode == 0, out.stderr[-2000:]
  assert sum('config.json is damaged' in l for l in out.stderr.splitlines()) == 1
  assert any(n.startswith('config.json.corrupt-') for n in os.listdir(tmp_path))
  assert rows(tmp_path) == uninterrupted
  assert subprocess.run([sys.executable, 'eval.py', f'--workdir={tmp_path}', '--split=test'],
                        cwd=ROOT, capture_output=True, timeout=300).returncode == 0


@pytest.mark.parametrize('bad', ['{"step": oops}\n', '\x00\x00\x00\n'])
def test_a_bad_line_inside_metrics_jsonl_is_set_aside_not_fatal(data_dir, tmp_path,
                                                                uninterrupted, bad, capfd):
  loop.train_and_evaluate(small(data_dir), str(tmp_path))
  path = tmp_path / 'metrics.jsonl'
  lines = path.read_text().splitlines(keepends=True)
  path.write_text(''.join(lines[:2] + [bad] + lines[2:] + lines[1:2]))  # and a duplicate row
  loop.train_and_evaluate(small(data_dir, steps=6), str(tmp_path))
  err = [l for l in capfd.readouterr().err.splitlines() if 'could not be read' in l]
  assert len(err) == 1 and 'line 3' in err[0]
  kept = [n for n in os.listdir(tmp_path) if n.startswith('metrics.jsonl.corrupt-')]
  assert len(kept) == 1 and bad in (tmp_path / kept[0]).read_text()
  assert rows(tmp_path) == uninterrupted  # the duplicate row is gone too


def test_metrics_jsonl_deleted_mid_run_is_written_again(data_dir, tmp_path, uninterrupted):
  def delete_at_3(step, state):
    del state
    if step == 3:
      os.remove(tmp_path / 'metrics.jsonl')

  loop.train_and_evaluate(small(data_dir, steps=6), str(tmp_path), hooks=(delete_at_3,))
  assert rows(tmp_path) == uninterrupted


def test_init_from_a_run_whose_newest_checkpoint_is_damaged_takes_the_previous(data_dir, tmp_path,
                                                                              capfd):
  import numpy as np
  from data import pipeline
  from training import state as state_lib
  source = tmp_path / 'source'
  loop.train_and_evaluate(small(data_dir), str(source))
  config = small(data_dir)
  vocab = pipeline.get_tokenizer(config.data).vocab_size
  _, _, fresh = state_lib.create_state(config, vocab)
  mngr = checkpointing.checkpoint_manager(str(source), config)
  want, _ = checkpointing.restore_state(mngr, fresh, 2)
  mngr.close()
  for d, _, files in os.walk(source / 'checkpoints' / '4' / 'state'):
    for f in files:
      os.truncate(os.path.join(d, f), 0)
  got, step = state_lib.init_from(fresh, str(source))
  assert step == 2
  assert 'checkpoint step 4 (' in capfd.readouterr().err
  for a, b in zip(jax_leaves(got['params']), jax_leaves(want['params'])):
    np.testing.assert_array_equal(a, b)
  for step_dir in ('2',):
    for d, _, files in os.walk(source / 'checkpoints' / step_dir / 'state'):
      for f in files:
        os.truncate(os.path.join(d, f), 0)
  with pytest.raises(state_lib.InitFromError,
                     match='no checkpoint can give this config its parameters'):
    state_lib.init_from(fresh, str(source))


def jax_leaves(tree):
  import jax
  return jax.tree.leaves(tree)


LATE_STEPS = 40  # at about 0.2 s a step here, far beyond the 4 s of the latest signal


@pytest.mark.parametrize('delay', [0.3, 1.5, 4.0])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(data_dir, tmp_path, uninterrupted,
                                                         delay):
  """At 0.3 s the imports run, at 1.5 s JAX starts, at 4 s the state compiles (or the loop,
  installed by then, saves and stops): each ends in one line with status 130. The run has
  LATE_STEPS steps, so that it cannot end before the latest signal (6 steps once did, with a warm
  machine); with a constant rate its first 6 steps are the uninterrupted run's."""
  import signal
  import time
  args = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
          f'--workdir={tmp_path}', f'--config.data.data_dir={data_dir}',
          f'--config.train.steps={LATE_STEPS}',
          '--config.train.checkpoint_every=2', '--config.train.log_every=1',
          '--config.train.eval_every=2', '--config.train.warmup_steps=0',
          '--config.train.schedule=constant']
  proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  time.sleep(delay)
  assert proc.poll() is None, 'the run ended before the signal: give it more steps'
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-2000:]
  assert 'Traceback' not in err, err[-2000:]
  assert err.strip().splitlines()[-1].startswith('train: stopped by SIGINT'), err[-2000:]
  if delay == 4.0:  # the latest stop (a checkpoint may exist): the same command resumes
    assert train_cli(tmp_path, data_dir, LATE_STEPS).returncode == 0
    resumed = rows(tmp_path)
    assert resumed[:len(uninterrupted)] == uninterrupted
    assert resumed[-1][0] == LATE_STEPS


def test_a_killed_sweep_runner_takes_its_cells_with_it(data_dir, tmp_path):
  """SIGKILL to the runner: its cell gets SIGTERM (it saves and stops) instead of running on,
  orphaned, and the same sweep command, rerun at once, finishes the cell."""
  import signal
  import time
  spec = tmp_path / 'one_cell.py'
  spec.write_text(
      'from configs import decoder_only\n'
      'def get_config(arg=None):\n'
      '  config = decoder_only.get_config("quick")\n'
      f'  config.data.data_dir = {str(data_dir)!r}\n'
      '  config.train.update(steps=400, checkpoint_every=50, log_every=10, eval_every=1000)\n'
      '  return config\n'
      'def get_sweep():\n'
      '  return {}\n')
  sweep_dir = tmp_path / 'sweep'
  command = [sys.executable, '-m', 'tools.sweep', f'--sweep={spec}', f'--sweep_dir={sweep_dir}']
  runner = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  metrics = sweep_dir / 'seed=0' / 'metrics.jsonl'
  deadline = time.monotonic() + 180
  while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
    time.sleep(0.5)
  assert metrics.exists(), 'the cell never logged a row'
  cell_pid = int((sweep_dir / 'seed=0' / 'lock').read_text().split()[0])
  runner.send_signal(signal.SIGKILL)
  runner.wait()
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline:
    try:
      os.kill(cell_pid, 0)
    except ProcessLookupError:
      break
    time.sleep(0.5)
  else:
    os.kill(cell_pid, signal.SIGKILL)
    pytest.fail('the cell ran on after its runner was killed')
  out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert max(r['step'] for r in writers.read_metrics(str(metrics))) == 400
