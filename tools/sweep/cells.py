"""One cell of a sweep: the state of its workdir, and one run of it (train.py, then its evals)."""

import dataclasses
import math
import os
import signal
import sys
import tempfile
import time
from typing import Callable, NamedTuple

from training import paths
from training import writers
from tools.sweep import processes
from tools.sweep import spec as sweep_spec

TRAIN_PY = os.path.join(processes.ROOT, 'train.py')
EVAL_PY = os.path.join(processes.ROOT, 'eval.py')


# --- A cell's workdir -----------------------------------------------------------------------------

def cell_status(workdir, steps):
  """'done' (final-step checkpoint present), 'diverged' (stopped on a non-finite loss), 'partial'
  (some checkpoint: train.py resumes it) or 'new'; with the newest checkpoint step (or None)."""
  checkpoints = paths.listdir(paths.join(workdir, 'checkpoints'))
  saved = sorted(int(d) for d in checkpoints if d.isdigit())
  latest = saved[-1] if saved else None
  if latest is not None and latest >= steps:
    return 'done', latest
  if _last_train_loss_nonfinite(paths.join(workdir, 'metrics.jsonl')):
    return 'diverged', latest
  return ('partial' if latest is not None else 'new'), latest


def _last_train_loss_nonfinite(path):
  if not paths.exists(path):
    return False
  train = [r for r in writers.read_metrics(path, warn=False) if r.get('split') == 'train']
  last = train[-1].get('loss') if train else None
  return last is not None and not math.isfinite(last)


def final_losses(workdir):
  """(last train loss, last validation loss) of the cell's metrics.jsonl, None where not logged."""
  path = paths.join(workdir, 'metrics.jsonl')
  valid = train = None
  if paths.exists(path):
    for row in writers.read_metrics(path, warn=False):
      if row.get('split') == 'valid':
        valid = row['loss']
      elif row.get('split') == 'train':
        train = row['loss']
  return train, valid


# --- Running a cell -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Context:
  """What every cell of one run of a sweep shares."""
  spec: str  # the sweep file as the cells are given it: an absolute 'path[:arg]'
  sweep: dict  # the sweep file's get_sweep(): its eval_flags and eval_variants
  sweep_dir: str  # absolute: the cells run from the repository root
  launch: Callable  # launch(argv, log_path, env) -> exit code, None when stopped before it began
  env: dict  # the cells' environment
  children: processes.Children  # its `signum` says whether a signal stops the sweep
  run_eval: bool  # run the eval.py commands of a cell that finished training


class Outcome(NamedTuple):
  """How a cell ended: its result, how it ran (for the progress line) and its wall time."""
  result: str  # done | skipped | diverged | failed (rc N) | stopped (rc N) | not started
  how: str  # 'new', 'resuming from step 40', 'done already', ...
  seconds: float = 0.0


def run_cell(ctx, cell, steps):
  """Trains `cell` to `steps` with train.py (resuming its newest checkpoint), then, with
  `ctx.run_eval`, runs its eval.py commands; a finished or diverged cell is not trained again, but
  a finished one stopped before its evaluations ended runs the ones it lacks.

  Returns:
    The cell's `Outcome`.
  """
  workdir = paths.join(ctx.sweep_dir, cell['name'])
  status, latest = cell_status(workdir, steps)
  missing = missing_evals(ctx, cell) if status == 'done' and ctx.run_eval else []
  if missing:
    start = time.perf_counter()
    how = 'done already; evaluations resumed' + run_evals(ctx, cell, only=missing)
    return Outcome('skipped', how, time.perf_counter() - start)
  if status in ('done', 'diverged'):
    return Outcome('skipped' if status == 'done' else 'diverged', f'{status} already')
  if ctx.children.signum:  # no new cell once the sweep is stopping
    return _not_started(ctx)
  paths.makedirs(workdir)
  how = f'resuming from step {latest}' if status == 'partial' else 'new'
  start = time.perf_counter()
  argv = sweep_spec.train_command(ctx.spec, ctx.sweep_dir, cell, sys.executable, TRAIN_PY)
  rc = launch_logged(ctx.launch, argv, paths.join(workdir, 'train.log'), ctx.env)
  if rc is None:
    return _not_started(ctx)
  status, _ = cell_status(workdir, steps)
  if rc == 0 and status == 'done' and ctx.run_eval:
    how += run_evals(ctx, cell)
  return Outcome(_result(rc, status, ctx.children.signum), how, time.perf_counter() - start)


def _not_started(ctx):
  return Outcome('not started', f'stopped by {signal.Signals(ctx.children.signum).name}')


def _result(rc, status, signum):
  """The result of a cell whose train.py exited with `rc`, leaving its workdir in `status`."""
  if status == 'diverged':
    return 'diverged'
  if rc == 0 and status == 'done':
    return 'done'
  if signum:
    return f'stopped (rc {rc})'
  return f'failed (rc {rc})'


def _eval_file(suffix):
  return f'eval_{suffix}.json' if suffix else 'eval.json'


def missing_evals(ctx, cell):
  """The suffixes of the cell's eval.py commands whose file its workdir lacks. Each variant writes
  eval.json before the runner renames it, and the plain evaluation runs last, so an eval.json is
  the plain one only when no variant's file is missing: the plain evaluation runs again then."""
  workdir = paths.join(ctx.sweep_dir, cell['name'])
  commands = sweep_spec.eval_commands(ctx.sweep, ctx.sweep_dir, cell, sys.executable, EVAL_PY)
  missing = [suffix for suffix, _ in commands
             if not paths.exists(paths.join(workdir, _eval_file(suffix)))]
  if missing and '' not in missing and any(suffix == '' for suffix, _ in commands):
    missing.append('')
  return missing


def run_evals(ctx, cell, only=None):
  """Runs the cell's eval.py commands (`sweep_spec.eval_commands`; with `only`, those whose
  suffix it lists, e.g. `missing_evals`), keeping each variant's eval.json as
  eval_<suffix>.json; returns what the progress line adds ('' when all went well)."""
  workdir = paths.join(ctx.sweep_dir, cell['name'])
  notes = ''
  commands = sweep_spec.eval_commands(ctx.sweep, ctx.sweep_dir, cell, sys.executable, EVAL_PY)
  if only is not None:
    commands = [(suffix, argv) for suffix, argv in commands if suffix in only]
  for suffix, argv in commands:
    if ctx.children.signum:
      return notes + '; eval not started (stopped)'
    rc = launch_logged(ctx.launch, argv, paths.join(workdir, 'eval.log'), ctx.env)
    if rc == 0 and suffix:  # eval.py writes eval.json: keep each variant's copy
      paths.replace(paths.join(workdir, 'eval.json'), paths.join(workdir, f'eval_{suffix}.json'))
    elif rc:
      notes += f'; eval failed (rc {rc}, see eval.log)'
  return notes


def launch_logged(launch, argv, log_path, env):
  """`launch(argv, log_path, env)`; a gs:// log (object storage cannot append) is written to a
  local file, then added to the end of the log object."""
  if not paths.is_remote(log_path):
    return launch(argv, log_path, env)
  with tempfile.TemporaryDirectory() as tmp:
    local = os.path.join(tmp, paths.basename(log_path))
    rc = launch(argv, local, env)
    with open(local, 'rb') as f:
      text = f.read()
  old = paths.read_bytes(log_path) if paths.exists(log_path) else b''
  paths.write_bytes(log_path, old + text)
  return rc


def single_thread_env():
  """Environment for a cell that shares the machine with others: one XLA/OpenMP thread."""
  env = dict(os.environ)
  xla = env.get('XLA_FLAGS', '')
  env['XLA_FLAGS'] = (xla + ' --xla_cpu_multi_thread_eigen=false '
                      'intra_op_parallelism_threads=1').strip()
  for var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
    env[var] = '1'
  return env
