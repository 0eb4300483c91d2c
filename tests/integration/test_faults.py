"""Faults that must never lose work or corrupt the record: a healthy checkpoint that does not fit
the config, unreadable checkpoints, a second run on a busy workdir, a config.json left by a run
that failed before saving, a failed save, eval beside a training run, and SIGKILL at random
moments of one run."""

import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from data import pipeline
from tests.helpers import ROOT, metric_rows, quick_config
from training import checkpointing
from training import evaluation
from training import lock
from training import loop


def small(data_dir, **train):
  return quick_config(data_dir, **{'steps': 4, 'checkpoint_every': 2, 'log_every': 1,
                                   'eval_every': 100, 'warmup_steps': 0, **train})


def test_a_healthy_checkpoint_of_another_model_is_refused_not_moved(data_dir, tmp_path):
  config = small(data_dir)
  loop.train_and_evaluate(config, str(tmp_path))
  os.remove(tmp_path / 'config.json')  # the resume check cannot compare configs any more
  before = (tmp_path / 'metrics.jsonl').read_text()
  other = small(data_dir)
  other.model.update(d_model=32, d_ff=128)
  with pytest.raises(checkpointing.IncompatibleResume,
                     match=r'checkpoint step 4 holds arrays of other shapes .*kernel: checkpoint'):
    loop.train_and_evaluate(other, str(tmp_path))
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']  # nothing moved aside
  assert (tmp_path / 'metrics.jsonl').read_text() == before


def test_the_cli_refuses_it_with_exit_2(data_dir, tmp_path):
  args = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
          f'--workdir={tmp_path}', f'--config.data.data_dir={data_dir}', '--config.train.steps=2',
          '--config.train.warmup_steps=0', '--config.train.checkpoint_every=2']
  assert subprocess.run(args, cwd=ROOT, capture_output=True).returncode == 0
  os.remove(tmp_path / 'config.json')
  out = subprocess.run(args + ['--config.model.d_model=32', '--config.model.d_ff=128'], cwd=ROOT,
                       capture_output=True, text=True)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1].startswith('train: cannot resume')


def test_every_checkpoint_unreadable_is_said_not_restarted(data_dir, tmp_path):
  config = small(data_dir)
  loop.train_and_evaluate(config, str(tmp_path))
  for step in ('2', '4'):
    for d, _, files in os.walk(tmp_path / 'checkpoints' / step / 'state'):
      for f in files:
        os.truncate(os.path.join(d, f), 0)
  rows = metric_rows(tmp_path)
  with pytest.raises(checkpointing.UnreadableCheckpoints, match='every checkpoint .* unreadable'):
    loop.train_and_evaluate(config, str(tmp_path))
  assert metric_rows(tmp_path) == rows  # the record is kept
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']  # a rerun says it again
  # eval.py says the same in one line (exit 1), not a parser message.
  out = subprocess.run([sys.executable, 'eval.py', f'--workdir={tmp_path}', '--split=test'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  assert out.stderr.strip().splitlines()[-1].startswith('eval: every checkpoint in'), out.stderr


def test_a_second_run_on_a_busy_workdir_is_refused_naming_the_holder(data_dir, tmp_path):
  config = small(data_dir)
  with lock.WorkdirLock(str(tmp_path)):
    with pytest.raises(lock.WorkdirBusy, match=f'in use by PID {os.getpid()} on '):
      loop.train_and_evaluate(config, str(tmp_path))
  assert not (tmp_path / 'checkpoints').exists()


def test_a_stale_lock_is_taken_over_with_a_note(data_dir, tmp_path, capfd):
  dead = subprocess.Popen(['true'])
  dead.wait()
  import socket
  (tmp_path / 'lock').write_text(f'{dead.pid} {socket.gethostname()}\n')
  loop.train_and_evaluate(small(data_dir, steps=2), str(tmp_path))
  assert f'took over the stale lock of PID {dead.pid}' in capfd.readouterr().err
  assert (tmp_path / 'lock').read_text() == ''  # released cleanly


def test_a_config_json_without_checkpoints_does_not_block_the_corrected_run(data_dir, tmp_path):
  failed = small(data_dir)
  failed.model.update(d_model=32, d_ff=128)
  (tmp_path / 'config.json').write_text(failed.to_json_best_effort())
  loop.train_and_evaluate(small(data_dir, steps=2), str(tmp_path))
  assert [r['step'] for r in metric_rows(tmp_path)] == [1, 2]


def test_a_failed_save_stops_with_one_line_and_exit_1(data_dir, tmp_path):
  """RLIMIT_FSIZE makes the checkpoint's data files too large to write (as a full disk would)."""
  pipeline.get_tokenizer(small(data_dir).data)  # the dataset is written before the limit applies

  def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
  args = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
          f'--config.data.data_dir={data_dir}', '--config.train.steps=12',
          '--config.train.checkpoint_every=4', '--config.train.eval_every=100']
  out = subprocess.run(args + [f'--workdir={tmp_path / "cut"}'], cwd=ROOT, capture_output=True,
                       text=True, preexec_fn=limit, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  line = [l for l in out.stderr.splitlines() if l.startswith('train: saving a checkpoint')]
  assert len(line) == 1 and 'File too large' in line[0] and 'free' in line[0], out.stderr[-2000:]
  assert 'no checkpoint was saved' in line[0]
  # Orbax's own report of the failed write is dropped, and the exit does not wait for its threads
  # (no shutdown noise); what may remain are tensorstore callbacks finding Orbax's event loop
  # closed (README, Reliability).
  assert 'Error writing' not in out.stderr.replace(line[0], '')
  assert 'meta_path' not in out.stderr, out.stderr[-3000:]
  # Every exception any trace ends in is that one. (Several tensorstore threads print at once, so
  # their traces can interleave: the exception lines are checked, not each trace's text.)
  raised = re.findall(r'^\s*(\w+(?:Error|Exception)\b.*)$', out.stderr, re.M)
  assert all(r.strip() == 'RuntimeError: Event loop is closed' for r in raised), out.stderr[-3000:]
  assert max(r['step'] for r in metric_rows(tmp_path / 'cut')) <= 8  # it did not train on
  # Room again: the same command ends as the uninterrupted run.
  assert subprocess.run(args + [f'--workdir={tmp_path / "cut"}'], cwd=ROOT,
                        capture_output=True, timeout=300).returncode == 0
  assert subprocess.run(args + [f'--workdir={tmp_path / "full"}'], cwd=ROOT,
                        capture_output=True, timeout=300).returncode == 0
  keys = ('step', 'split', 'loss', 'accuracy', 'grad_norm')
  rows = lambda w: [tuple(r.get(k) for k in keys) for r in metric_rows(tmp_path / w)]  # noqa: E731
  assert rows('cut') == rows('full')


def test_eval_falls_back_from_a_damaged_newest_checkpoint(data_dir, tmp_path):
  loop.train_and_evaluate(small(data_dir), str(tmp_path))
  for d, _, files in os.walk(tmp_path / 'checkpoints' / '4' / 'state'):
    for f in files:
      os.truncate(os.path.join(d, f), 0)
  _, _, _, step = evaluation.load_run(str(tmp_path))
  assert step == 2
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2', '4']  # eval moves nothing


def _params(workdir):
  _, _, variables, step = evaluation.load_run(str(workdir))
  return step, jax.tree.leaves(variables)


def _committed_and_written(workdir):
  """{name: step} of the step folders in WORKDIR/checkpoints: committed (`4`) or being written
  (Orbax's `4.orbax-checkpoint-tmp`, renamed to `4` once complete)."""
  try:
    names = os.listdir(os.path.join(workdir, 'checkpoints'))
  except FileNotFoundError:
    return {}
  return {n: int(m.group(1)) for n in names for m in [re.match(r'(\d+)(\.|$)', n)] if m}


def _logged_steps(workdir):
  """The train rows' steps in metrics.jsonl (a last line being written is not counted)."""
  try:
    text = (workdir / 'metrics.jsonl').read_text()
  except FileNotFoundError:
    return []
  rows = [json.loads(line) for line in text.split('\n')[:-1]]
  return [r['step'] for r in rows if r['split'] == 'train']


def _inode(path):
  try:
    return os.stat(path).st_ino
  except FileNotFoundError:
    return None


def test_sigkill_at_ten_random_moments_resumes_to_the_uninterrupted_run(data_dir, tmp_path):
  """Killed (SIGKILL) ten times, each at a moment drawn at random (fixed seed) and waited for:
  right after the start-up rewrite of metrics.jsonl, right after the train row of a drawn step, or
  as a drawn checkpoint step's folder appears (being written, or just committed); rerun each time.
  Every kill lands while the run is still going, and the final metrics.jsonl and parameters are
  the uninterrupted run's."""
  steps, every, log_every, kills = 60, 3, 2, 10
  flags = ['--config=configs/decoder_only.py:quick', f'--config.data.data_dir={data_dir}',
           f'--config.train.steps={steps}', f'--config.train.checkpoint_every={every}',
           f'--config.train.log_every={log_every}', '--config.train.eval_every=20',
           '--config.train.keep_checkpoints=2']
  run = lambda w: [sys.executable, 'train.py', *flags, f'--workdir={w}']  # noqa: E731
  full = subprocess.run(run(tmp_path / 'full'), cwd=ROOT, capture_output=True, text=True)
  assert full.returncode == 0, full.stderr[-2000:]
  cut = tmp_path / 'cut'
  last_target = steps - 10  # the last moment drawn is well before the run's end
  rng = random.Random(0)
  landed = []
  for kill in range(kills):
    logged = max(_logged_steps(cut), default=0)
    committed = max((s for n, s in _committed_and_written(cut).items() if n.isdigit()), default=0)
    kinds = (['row'] * (logged + 4 * log_every <= last_target) +
             ['save'] * (committed + 2 * every <= last_target))
    kinds += ['rewrite'] * (logged > 0)  # the rows after the checkpoint are dropped at start-up
    kind = rng.choice(kinds)
    if kind == 'row':  # a train row of a step not logged yet
      target = logged + log_every * rng.randint(1, 4)
    elif kind == 'save':  # a checkpoint step not saved yet
      target = committed + every * rng.randint(1, 2)
    else:
      target = _inode(cut / 'metrics.jsonl')
    before = set(_committed_and_written(cut))
    log = open(tmp_path / f'run{kill}.stderr', 'w')
    proc = subprocess.Popen(run(cut), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)
    started = time.time()
    deadline = started + 240
    while True:
      if kind == 'row':
        seen = max(_logged_steps(cut), default=0) >= target
      elif kind == 'save':
        seen = [n for n, s in _committed_and_written(cut).items()
                if s == target and n not in before]
      else:
        seen = _inode(cut / 'metrics.jsonl') != target
      if seen or proc.poll() is not None or time.time() > deadline:
        break
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    landed.append((kind, target, seen, proc.returncode, round(time.time() - started, 1)))
    assert proc.returncode == -signal.SIGKILL and seen, (
        landed, (tmp_path / f'run{kill}.stderr').read_text()[-2000:])
  # Every kill landed inside the run, at the moment drawn for it.
  assert len(landed) == kills and all(r == -signal.SIGKILL for *_, r, _ in landed), landed
  last = subprocess.run(run(cut), cwd=ROOT, capture_output=True, text=True)
  assert last.returncode == 0, last.stderr[-2000:]
  keys = ('step', 'split', 'loss', 'accuracy', 'grad_norm', 'param_norm', 'learning_rate')
  rows = lambda w: [tuple(r.get(k) for k in keys)  # noqa: E731
                    for r in map(json.loads,
                                 (tmp_path / w / 'metrics.jsonl').read_text().split('\n')[:-1])]
  assert rows('cut') == rows('full')
  step_full, full_params = _params(tmp_path / 'full')
  step_cut, cut_params = _params(tmp_path / 'cut')
  assert step_full == step_cut == 60
  for a, b in zip(full_params, cut_params):
    np.testing.assert_array_equal(a, b)
