"""A preemption storm: train.py stopped by SIGTERM at random steps, some of them while a checkpoint
is being written, and rerun each time, ends with the uninterrupted run's metrics row for row and
its parameters bit for bit.

The test tier runs 3 interruptions; the 20-interruption storm whose figures docs/reliability.md
reports is this file run as a script:
`python -m tests.integration.test_preemption_storm --interruptions=20 --during_save=2`
(`--gs`: the workdirs on the local GCS emulator).
"""

import argparse
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--interruptions', type=int, default=20)
  parser.add_argument('--during_save', type=int, default=2)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--gs', action='store_true', help='the workdirs on the GCS emulator')
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
    figures = (gs_storm(data_dir, args.interruptions, args.seed, root) if args.gs else
               storm(root, data_dir, args.interruptions, args.during_save, args.seed))
  for run in figures.pop('runs'):
    print(run)
  print(figures)


if __name__ == '__main__':
  main()
