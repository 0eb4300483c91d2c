"""A preemption storm: train.py stopped by SIGTERM at random steps, some of them while a checkpoint
is being written, and rerun each time, ends with the uninterrupted run's metrics row for row and
its parameters bit for bit.

The test tier runs 3 interruptions; the 20-interruption storm whose figures docs/reliability.md
reports is this file run as a script:
`python -m tests.integration.test_preemption_storm --interruptions=20 --during_save=2`
(`--gs`: the workdirs on the local GCS emulator; `--sweep`: the runner of a real tuned sweep,
`tools.sweep --tune --parallel=2`, SIGKILLed instead).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from tests.helpers import ROOT
from tests.helpers import gcs_emulator
from training import evaluation
from training import paths
from training import writers

STEPS = 40
KEYS = ('step', 'split', 'loss', 'accuracy', 'grad_norm', 'param_norm', 'learning_rate')


def command(workdir, data_dir):
  return [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
          f'--config.data.data_dir={data_dir}', f'--config.train.steps={STEPS}',
          '--config.train.checkpoint_every=2', '--config.train.log_every=1',
          '--config.train.eval_every=10', '--config.train.keep_checkpoints=2',
          f'--workdir={workdir}']


def rows(workdir):
  path = paths.join(workdir, 'metrics.jsonl')
  return [tuple(r.get(k) for k in KEYS) for r in writers.read_metrics(path, warn=False)]


def last_step(workdir):
  try:
    return max((r[0] for r in rows(workdir) if r[1] == 'train'), default=0)
  except (OSError, ValueError):  # not written yet, or a torn last line
    return 0


def saving(workdir):
  """Whether Orbax is writing a checkpoint (its temporary step directory exists; on gs://, where
  Orbax writes in place, never)."""
  try:
    return any('tmp' in name for name in paths.listdir(paths.join(workdir, 'checkpoints')))
  except OSError:
    return False


def interrupt(workdir, data_dir, until, timeout=300, poll=0.002):
  """Starts the run, sends SIGTERM once `until()` holds; (exit status, stop step, seconds from
  the start to the first new row, seconds in all, whether a save was in flight at the signal)."""
  start, before = time.monotonic(), last_step(workdir)
  proc = subprocess.Popen(command(workdir, data_dir), cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  first_row = None
  while proc.poll() is None and time.monotonic() - start < timeout:
    if first_row is None and last_step(workdir) > before:
      first_row = time.monotonic() - start
    if until():
      in_save = saving(workdir)
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(poll)
  else:
    in_save = False
  _, err = proc.communicate(timeout=timeout)
  line = err.strip().splitlines()[-1] if err.strip() else ''
  stopped = int(line.split('after step ')[1].split(';')[0]) if 'after step ' in line else None
  return proc.returncode, stopped, first_row, time.monotonic() - start, in_save, err


def storm(root, data_dir, interruptions, during_save, seed=0, poll=0.002):
  """The uninterrupted run in `root`/full, the stormed one in `root`/cut (local or gs://); the
  figures."""
  full = paths.join(root, 'full')
  start = time.monotonic()
  done = subprocess.run(command(full, data_dir), cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-2000:]
  full_s = time.monotonic() - start
  rng = random.Random(seed)
  targets = sorted(rng.sample(range(1, STEPS - 2), interruptions))
  in_save_at = set(rng.sample(range(interruptions), during_save))
  cut, runs = paths.join(root, 'cut'), []
  for i, target in enumerate(targets):
    target = max(target, last_step(cut) + 1)  # a run may stop a step or two after its signal
    if target >= STEPS:
      break
    if i in in_save_at:  # the first save this run starts after reaching the target
      until = lambda t=target: last_step(cut) >= t and saving(cut)  # noqa: E731
    else:
      until = lambda t=target: last_step(cut) >= t  # noqa: E731
    rc, stopped, first_row, wall, in_save, err = interrupt(cut, data_dir, until, poll=poll)
    assert rc == 128 + signal.SIGTERM, (rc, err[-2000:])
    assert stopped is not None and paths.isdir(paths.join(cut, 'checkpoints', str(stopped)))
    assert in_save or i not in in_save_at, f'interruption {i}: no save was in flight'
    runs.append({'target': target, 'stopped': stopped, 'first_row_s': first_row, 'wall_s': wall,
                 'in_save': in_save})
  start = time.monotonic()
  last = subprocess.run(command(cut, data_dir), cwd=ROOT, capture_output=True, text=True)
  assert last.returncode == 0, last.stderr[-2000:]
  cut_s = sum(r['wall_s'] for r in runs) + time.monotonic() - start
  assert rows(cut) == rows(full)
  _, _, full_vars, full_step = evaluation.load_run(full)
  _, _, cut_vars, cut_step = evaluation.load_run(cut)
  assert full_step == cut_step == STEPS
  import jax
  for a, b in zip(jax.tree.leaves(full_vars), jax.tree.leaves(cut_vars), strict=True):
    np.testing.assert_array_equal(a, b)
  return {'interruptions': len(runs), 'during_save': sum(r['in_save'] for r in runs),
          'rows': len(rows(cut)), 'full_s': full_s, 'stormed_s': cut_s,
          'lost_per_interruption_s': (cut_s - full_s) / len(runs),
          'start_to_first_row_s': float(np.median([r['first_row_s'] for r in runs
                                                   if r['first_row_s'] is not None])),
          'runs': runs}


def test_sigterm_three_times_one_during_a_save_resumes_to_the_uninterrupted_run(data_dir,
                                                                                tmp_path):
  figures = storm(str(tmp_path), data_dir, interruptions=3, during_save=1)
  assert figures['interruptions'] == 3 and figures['during_save'] >= 1
  assert figures['rows'] == STEPS + STEPS // 10  # every train row and every valid row compared


def gs_storm(data_dir, interruptions, seed, scratch):
  """`storm` with both workdirs in gs://bucket (the local emulator), the data local."""
  with gcs_emulator(TENSORSTORE_GCS_HTTP_URL='{url}', GOOGLE_AUTH_TOKEN_FOR_TESTING='emulator',
                    TENSORSTORE_GCS_REQUEST_CONCURRENCY='8',
                    ATTNLAB_DATA_CACHE=os.path.join(scratch, 'cache')):
    # Orbax writes in place on gs:// (no temporary step folder to aim at), and the emulator
    # answers one request at a time: poll it gently.
    return storm('gs://bucket/storm', data_dir, interruptions, 0, seed, poll=0.2)


# A real tuned sweep of the quick config: 2 cells x 2 learning rates at seed 0, then each cell's
# seed 1 at its chosen rate (6 train.py runs).
SWEEP_STEPS = 6
SWEEP = '''
from configs import decoder_only


def get_config(arg=None):
  config = decoder_only.get_config('quick')
  config.data.data_dir = DATA_DIR
  config.train.update(steps=STEPS, warmup_steps=0, checkpoint_every=2, log_every=1, eval_every=3)
  return config


def get_sweep():
  return {'grid': {'model.norm_position': ['pre', 'post']}, 'seeds': [0, 1]}
'''
TUNE = 'train.learning_rate:1e-3,1e-2'


def sweep_command(spec, sweep_dir):
  return [sys.executable, '-m', 'tools.sweep', f'--sweep={spec}', f'--sweep_dir={sweep_dir}',
          f'--tune={TUNE}', '--parallel=2']


def run_sweep(spec, sweep_dir, kill_after=None):
  """Runs the sweep runner, SIGKILLed (the runner alone: its cells get SIGTERM, save and stop)
  `kill_after` seconds in; (exit status, seconds)."""
  start = time.monotonic()
  with open(os.path.join(os.path.dirname(spec), 'runner.log'), 'a') as log:
    proc = subprocess.Popen(sweep_command(spec, sweep_dir), cwd=ROOT, stdout=log, stderr=log)
    try:
      proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
  return proc.returncode, time.monotonic() - start


def retrained(sweep_dir):
  """The cells a launch resumed at their final step: trained again once finished."""
  return [cell for cell in os.listdir(sweep_dir) if os.path.isdir(os.path.join(sweep_dir, cell))
          and f'resumed from step {SWEEP_STEPS} ' in open(
              os.path.join(sweep_dir, cell, 'train.log'), errors='replace').read()]


def sweep_storm(root, data_dir, interruptions, seed=0):
  """The tuned sweep uninterrupted in `root`/full, and in `root`/cut with its runner SIGKILLed
  `interruptions` times at random moments, rerun each time; the figures."""
  spec = os.path.join(root, 'storm_sweep.py')
  with open(spec, 'w') as f:
    f.write(SWEEP.replace('DATA_DIR', repr(str(data_dir))).replace('STEPS', str(SWEEP_STEPS)))
  full, cut = os.path.join(root, 'full'), os.path.join(root, 'cut')
  # The stormed sweep first: it compiles into an empty JAX cache, the uninterrupted one after it
  # finds the programs there, so the time lost is not understated. The kills come within the
  # first seconds of each rerun (a train.py start is about 10 s here), so that each finds cells
  # starting, training or saving.
  rng, runs = random.Random(seed), []
  for _ in range(interruptions):
    rc, wall = run_sweep(spec, cut, kill_after=rng.uniform(1, 25))
    runs.append({'rc': rc, 'wall_s': wall})
    if rc != -signal.SIGKILL:  # it finished before the kill
      break
  rc, wall = run_sweep(spec, cut)
  assert rc == 0, open(os.path.join(root, 'runner.log')).read()[-3000:]
  cut_s = sum(r['wall_s'] for r in runs) + wall
  rc, full_s = run_sweep(spec, full)
  assert rc == 0, open(os.path.join(root, 'runner.log')).read()[-3000:]
  cells = sorted(c for c in os.listdir(full) if os.path.isdir(os.path.join(full, c)))
  assert cells == sorted(c for c in os.listdir(cut) if os.path.isdir(os.path.join(cut, c)))
  assert len(cells) == 6
  compared = 0
  for cell in cells:
    assert rows(os.path.join(cut, cell)) == rows(os.path.join(full, cell)), cell
    compared += len(rows(os.path.join(cut, cell)))
  tuned = [json.load(open(os.path.join(d, 'tune.json'))) for d in (full, cut)]
  assert tuned[0] == tuned[1]
  assert retrained(cut) == [] and retrained(full) == []
  killed = sum(r['rc'] == -signal.SIGKILL for r in runs)
  return {'interruptions': killed, 'cells': len(cells), 'rows': compared, 'full_s': full_s,
          'stormed_s': cut_s, 'lost_per_interruption_s': (cut_s - full_s) / max(killed, 1),
          'runs': runs}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--interruptions', type=int, default=20)
  parser.add_argument('--during_save', type=int, default=2)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--gs', action='store_true', help='the workdirs on the GCS emulator')
  parser.add_argument('--sweep', action='store_true',
                      help='SIGKILL the runner of a tuned sweep (--tune, --parallel=2) instead')
  args = parser.parse_args()
  from training import host
  host.cpu_when_no_accelerator()  # as conftest.py: no libtpu start-up probe on a CPU host
  os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                        os.path.join(tempfile.gettempdir(), 'attnlab_storm_jax_cache'))
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.25')
  with tempfile.TemporaryDirectory() as root:
    from data import toy_translation
    toy_translation.prepare(os.path.join(root, 'tfds'), 'base')
    data_dir = os.path.join(root, 'tfds')
    if args.sweep:
      figures = sweep_storm(root, data_dir, args.interruptions, args.seed)
    elif args.gs:
      figures = gs_storm(data_dir, args.interruptions, args.seed, root)
    else:
      figures = storm(root, data_dir, args.interruptions, args.during_save, args.seed)
  for run in figures.pop('runs'):
    print(run)
  print(figures)


if __name__ == '__main__':
  main()
