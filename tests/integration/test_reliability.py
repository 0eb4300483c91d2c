"""Faults and bad input: signals, damaged checkpoints, changed configs, NaNs, determinism, and the
catalogue of invalid configs (each one line naming the field, exit code 2, no traceback)."""

import json
import os
import signal
import subprocess
import shutil
import sys
import time

import numpy as np
import pytest

from configs import decoder_only
from training import validation
from data import pipeline
from tests.helpers import ROOT, metric_rows, quick_config
from training import checkpointing
from training import loop


metrics = metric_rows


def cli(*args, timeout=180):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def test_workdir_that_is_a_file_and_unwritable_data_dir(tmp_path):
  afile = tmp_path / 'afile'
  afile.write_text('x')
  base = [os.path.join(ROOT, 'train.py'), f'--config={ROOT}/configs/decoder_only.py:quick']
  out = cli(*base, f'--workdir={afile}')
  assert out.returncode == 2 and out.stderr.strip().count('\n') == 0, out.stderr
  assert 'workdir=' in out.stderr and 'is a file' in out.stderr
  out = cli(*base, f'--workdir={tmp_path / "w"}', f'--config.data.data_dir={afile}/tfds')
  assert out.returncode == 2 and out.stderr.strip().count('\n') == 0, out.stderr
  assert 'data.data_dir=' in out.stderr


def test_eval_without_checkpoint_says_so(tmp_path, data_dir):
  config = quick_config(data_dir)
  os.makedirs(tmp_path / 'w')
  (tmp_path / 'w' / 'config.json').write_text(config.to_json_best_effort())
  out = cli(os.path.join(ROOT, 'eval.py'), f'--workdir={tmp_path / "w"}')
  assert out.returncode != 0
  assert out.stderr.strip().splitlines() == [f'eval: no checkpoint in {tmp_path / "w"}/checkpoints']


def test_eval_beyond_learned_table_is_one_line(tmp_path, data_dir):
  config = quick_config(data_dir, steps=2, warmup_steps=0, checkpoint_every=2, eval_every=2,
                        log_every=1)
  config.model.position = 'learned'
  loop.train_and_evaluate(config, str(tmp_path))
  out = cli(os.path.join(ROOT, 'eval.py'), f'--workdir={tmp_path}', '--lengths=1,2')
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and 'max_length=64' in lines[0], out.stderr


# --- Faults ------------------------------------------------------------------------------------
def test_sigterm_saves_and_the_rerun_resumes(tmp_path, data_dir):
  workdir = tmp_path / 'w'
  args = [os.path.join(ROOT, 'train.py'), f'--config={ROOT}/configs/decoder_only.py:quick',
          f'--config.data.data_dir={data_dir}', '--config.train.steps=400',
          '--config.train.checkpoint_every=1000', '--config.train.log_every=1',
          '--config.train.eval_every=1000', f'--workdir={workdir}']
  proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 120
  while time.time() < deadline:  # wait until it is training
    if (workdir / 'metrics.jsonl').exists() and len(metrics(workdir)) >= 3:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signal.SIGTERM, err
  stopped = int(err.strip().splitlines()[-1].split('after step ')[1].split(';')[0])
  assert 3 <= stopped < 400
  assert os.path.isdir(workdir / 'checkpoints' / str(stopped))  # saved at the step it stopped
  out = cli(*args[:3], '--config.train.steps=' + str(stopped + 3), *args[4:])
  assert out.returncode == 0, out.stderr
  assert f'resumed from step {stopped}' in out.stderr
  assert f'resuming with changed train.steps (400 -> {stopped + 3})' in out.stderr
  assert [r['step'] for r in metrics(workdir)] == list(range(1, stopped + 4))


def _damage(step_dir, how):
  files = sorted((os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs),
                 key=os.path.getsize)
  if how == 'truncate':
    for path in files:
      if os.path.getsize(path) > 64:
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 3)
  else:
    for path in files:
      if 'state' in path:
        os.remove(path)


@pytest.mark.parametrize('how', ['truncate', 'missing'])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, data_dir, how, capsys):
  config = quick_config(data_dir, steps=10, checkpoint_every=5, log_every=1, eval_every=100)
  loop.train_and_evaluate(config, str(tmp_path))
  _damage(tmp_path / 'checkpoints' / '10', how)
  capsys.readouterr()
  config.train.steps = 12
  loop.train_and_evaluate(config, str(tmp_path))
  err = capsys.readouterr().err
  assert 'checkpoint step 10' in err and 'unreadable' in err, err
  assert 'resumed from step 5' in err
  assert [r['step'] for r in metrics(tmp_path)] == list(range(1, 13))
  assert any(name.startswith('corrupt-10-') for name in os.listdir(tmp_path / 'checkpoints'))


def test_resume_with_a_different_model_is_refused(tmp_path, data_dir):
  config = quick_config(data_dir, steps=2, warmup_steps=0, checkpoint_every=2, log_every=1,
                        eval_every=100)
  loop.train_and_evaluate(config, str(tmp_path))
  config.model.d_model = 32
  config.model.num_layers = 3
  with pytest.raises(checkpointing.IncompatibleResume) as e:
    loop.train_and_evaluate(config, str(tmp_path))
  assert 'model.d_model (64 -> 32)' in str(e.value) and 'model.num_layers (2 -> 3)' in str(e.value)
  assert '\n' not in str(e.value)


class _Poisoned:
  """Wraps the train iterator: batch `at` (1-based) gets NaN loss weights."""

  def __init__(self, it, at):
    self.it, self.at, self.n = it, at, 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = dict(next(self.it))
    self.n += 1
    if self.n == self.at:
      batch['weights'] = np.full_like(batch['weights'], np.nan)
    return batch

  def get_state(self):
    return self.it.get_state()

  def set_state(self, state):
    self.it.set_state(state)


@pytest.mark.parametrize('skip', [False, True])
def test_non_finite_loss_stops_or_is_skipped(tmp_path, data_dir, monkeypatch, skip):
  make = pipeline.make_iterator
  monkeypatch.setattr(pipeline, 'make_iterator', lambda *a, **k: (
      _Poisoned(make(*a, **k), 4) if a[1] == 'train' else make(*a, **k)))
  config = quick_config(data_dir, steps=8, checkpoint_every=2, log_every=1, eval_every=100,
                        skip_nonfinite=skip)
  if not skip:
    with pytest.raises(loop.NonFiniteLoss, match='non-finite loss .* at step 4.*step 2'):
      loop.train_and_evaluate(config, str(tmp_path))
    return
  loop.train_and_evaluate(config, str(tmp_path))
  rows = metrics(tmp_path)
  assert [r['step'] for r in rows] == list(range(1, 9))
  assert rows[-1]['skipped_steps'] == 1
  assert all(np.isfinite(r['loss']) for r in rows)


def test_same_seed_gives_bitwise_identical_metrics(tmp_path, data_dir):
  config = quick_config(data_dir, steps=6, log_every=1, eval_every=3)
  loop.train_and_evaluate(config, str(tmp_path / 'a'))
  loop.train_and_evaluate(config, str(tmp_path / 'b'))
  keys = ('step', 'split', 'loss', 'accuracy', 'grad_norm', 'param_norm')
  strip = lambda rows: [tuple(r.get(k) for k in keys) for r in rows]
  assert strip(metrics(tmp_path / 'a', 'train')) == strip(metrics(tmp_path / 'b', 'train'))
  assert strip(metrics(tmp_path / 'a', 'valid')) == strip(metrics(tmp_path / 'b', 'valid'))


def test_checkpoint_of_the_old_layout_resumes_to_its_losses(tmp_path, data_dir):
  """A workdir written at 15689df (train.py as one file) restores at step 2 and trains steps 3-4
  to the losses that run logged."""
  fixture = os.path.join(ROOT, 'tests', 'fixtures', 'checkpoint_15689df')
  workdir = tmp_path / 'run'
  shutil.copytree(fixture, workdir)
  config = validation.resolve(decoder_only.get_config('quick'))
  config.data.data_dir = str(data_dir)
  config.model.update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, d_ff=64)
  config.train.update(steps=4, warmup_steps=0, checkpoint_every=2, log_every=1, eval_every=4,
                      batch_size=4, schedule='cosine')  # that run's schedule
  validation.validate(config)
  loop.train_and_evaluate(config, str(workdir))
  with open(os.path.join(fixture, 'expected_metrics.jsonl')) as f:
    expected = [json.loads(line) for line in f]
  got = metric_rows(workdir) + metric_rows(workdir, 'valid')
  assert [(r['step'], r['split']) for r in got] == [(r['step'], r['split']) for r in expected]
  np.testing.assert_allclose([r['loss'] for r in got], [r['loss'] for r in expected], rtol=1e-6)
