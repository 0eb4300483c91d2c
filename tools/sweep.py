"""Sweeps: expand a configs/ablations/*.py grid into named cells and run each with train.py.

    python -m tools.sweep --sweep=configs/ablations/NAME.py[:ARG] --sweep_dir=DIR
        [--dry_run] [--seeds=0,1,2] [--parallel=N] [--sweep_eval]

A sweep file defines `get_config(arg=None)`, the base config of every cell, and `get_sweep()` (or
`get_sweep(arg=None)`, given the same `:ARG` as get_config, e.g. to shorten a `quick` sweep):

    {'grid': {'model.norm_position': ['pre', 'post'], 'train.warmup_steps': [0, 100]},
     'cells': [{'model.num_layers': 6}, {'model.num_layers': 12, 'train.learning_rate': 1e-3}],
     'seeds': [0, 1, 2],
     'eval_flags': ['--lengths=1,2,4'],
     'eval_variants': {'model.position=rope': ['--rope_scaling=ntk:4']}}

`'train.init_from': {'cell': {overrides}}` starts a cell from an earlier cell's parameters (same
seed; its workdir is passed), once that cell is done, also with --parallel (context_extension.py).

Every key is optional. `grid` is a full Cartesian product; `cells` an explicit list of override
dicts (for grids that are not full); with both, every cell is crossed with the grid. Overrides are
dotted config fields -> values. `seeds` set `train.seed` (default [0]). `eval_flags` are eval.py
flags for every cell (run with `--sweep_eval`, printed by `--dry_run`); `eval_variants` maps a cell
selector (`field=value[,field=value]`, matched against the cell's overrides) to further eval.py
runs of the same checkpoint, one per flag string.

A cell's name lists its overrides sorted by field, then its seed:
`model.norm_position=post,train.warmup_steps=0,seed=1`; names are stable (independent of the order
the file lists fields in) and filesystem-safe. Each cell trains in `SWEEP_DIR/<name>` with
`train.py --config=<sweep file> --config.FIELD=VALUE ...`.

SIGINT (Ctrl-C) or SIGTERM to the runner is forwarded to the cells running at that moment, which
save a checkpoint and stop; the runner waits for them, starts no further cell (nor eval), and
exits with 128 + the signal's number. Rerunning the same command resumes the sweep.
"""

import concurrent.futures
import math
import os
import shlex
import signal
import sys
import threading
import tempfile
import time

from absl import app
from absl import flags

from training import writers
from tools import processes
from training import cli_checks
from training import paths

# The sweep file and its cells (tools/sweep_spec.py), used here and by other tools as sweep.NAME.
from tools.sweep_spec import (  # pylint: disable=g-importing-member,unused-import
    MAX_NAME, ROOT, SWEEP_KEYS, SweepError, cell_config, cell_name, eval_commands, expand,
    format_value, get_sweep, load_sweep_module, parse_seeds, split_spec, train_command)


class Stopped(Exception):
  """SIGINT or SIGTERM stopped the sweep: running cells saved and stopped, later ones never began."""

  def __init__(self, signum, results):
    super().__init__(f'sweep: stopped by {signal.Signals(signum).name}')
    self.signum, self.results = signum, results



def cell_status(workdir, steps):
  """'done' (final-step checkpoint present), 'diverged' (stopped on a non-finite loss), 'partial'
  (some checkpoint: train.py resumes it) or 'new'; with the newest checkpoint step (or None)."""
  saved = sorted(int(d) for d in paths.listdir(paths.join(workdir, 'checkpoints')) if d.isdigit())
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


def _single_thread_env():
  """Environment for a cell that shares the machine with others: one XLA/OpenMP thread."""
  env = dict(os.environ)
  xla = env.get('XLA_FLAGS', '')
  env['XLA_FLAGS'] = (xla + ' --xla_cpu_multi_thread_eigen=false '
                      'intra_op_parallelism_threads=1').strip()
  for var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
    env[var] = '1'
  return env


def _final_loss(workdir):
  path = paths.join(workdir, 'metrics.jsonl')
  valid = train = None
  if paths.exists(path):
    for row in writers.read_metrics(path, warn=False):
      if row.get('split') == 'valid':
        valid = row['loss']
      elif row.get('split') == 'train':
        train = row['loss']
  return train, valid


def _launch_logged(launch, argv, log_path, env):
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


def run_sweep(spec, sweep_dir, *, seeds=None, dry_run=False, parallel=1, run_eval=False,
              launch=None, out=sys.stdout, children=None):
  """Runs (or with `dry_run` prints) every cell of the sweep file `spec` ('path[:arg]').

  Cells already finished (final-step checkpoint) are skipped, and so are cells that stopped on a
  non-finite loss (rerunning would diverge again at the same step; delete the workdir to retry);
  interrupted cells resume from their newest checkpoint (train.py does that). Each cell's output
  goes to `<cell>/train.log`; one progress line per cell goes to `out`.

  Args:
    spec: the sweep file, optionally with `:ARG` for its get_config.
    sweep_dir: the sweep's directory (one workdir per cell).
    seeds: None (the file's seeds) or a list overriding them.
    dry_run: print the commands and run nothing.
    parallel: cells run side by side as subprocesses, each with one XLA/OpenMP thread.
    run_eval: after a cell trains, run its eval.py commands (`eval_flags`, `eval_variants`).
    launch: `launch(argv, log_path, env) -> exit code` (tests replace it); default
      `children.launch`.
    children: the `tools.processes.Children` whose signal stops the sweep (default a new one, which forwards
      SIGINT and SIGTERM to the running cells while the sweep runs).

  Returns:
    {cell name: status}, status one of done | skipped | diverged | failed (rc N) | dry_run.

  Raises:
    Stopped: a SIGINT or SIGTERM arrived; the cells it reached have saved and stopped (status
      'stopped (rc N)'), later ones never started ('not started'); `results` holds every status.
  """
  children = children or processes.Children()
  launch = launch or children.launch
  path, arg = split_spec(spec)
  module = load_sweep_module(path)
  sweep = get_sweep(module, arg)
  cells = expand(sweep, seeds)
  # Validate every cell before the first one runs: a typo in the last cell should not surface
  # after hours of the others.
  configs = {c['name']: cell_config(module, arg, c) for c in cells}
  n = len(cells)
  if dry_run:
    for c in cells:
      print(shlex.join(train_command(spec, sweep_dir, c)), file=out)
      for _, argv in eval_commands(sweep, sweep_dir, c):
        print(shlex.join(argv), file=out)
    return {c['name']: 'dry_run' for c in cells}

  paths.makedirs(sweep_dir)
  # Cells run from the repository root: give them absolute paths.
  sweep_dir = paths.absolute(sweep_dir)
  spec = os.path.abspath(path) + (f':{arg}' if arg else '')
  env = _single_thread_env() if parallel > 1 else dict(os.environ)
  train_py, eval_py = os.path.join(ROOT, 'train.py'), os.path.join(ROOT, 'eval.py')
  results = {}

  def run_cell(i, c):
    workdir = paths.join(sweep_dir, c['name'])
    status, latest = cell_status(workdir, configs[c['name']].train.steps)
    if status in ('done', 'diverged'):
      return i, c, ('skipped' if status == 'done' else 'diverged'), f'{status} already', 0.0
    if children.signum:  # no new cell once the sweep is stopping
      return i, c, 'not started', f'stopped by {signal.Signals(children.signum).name}', 0.0
    paths.makedirs(workdir)
    how = f'resuming from step {latest}' if status == 'partial' else 'new'
    start = time.perf_counter()
    rc = _launch_logged(launch, train_command(spec, sweep_dir, c, sys.executable, train_py),
                        paths.join(workdir, 'train.log'), env)
    if rc is None:
      return i, c, 'not started', f'stopped by {signal.Signals(children.signum).name}', 0.0
    status, _ = cell_status(workdir, configs[c['name']].train.steps)
    if rc == 0 and status == 'done' and run_eval:
      for suffix, argv in eval_commands(sweep, sweep_dir, c, sys.executable, eval_py):
        if children.signum:
          how += '; eval not started (stopped)'
          break
        erc = _launch_logged(launch, argv, paths.join(workdir, 'eval.log'), env)
        if erc == 0 and suffix:  # eval.py writes eval.json: keep each variant's copy
          paths.replace(paths.join(workdir, 'eval.json'), paths.join(workdir, f'eval_{suffix}.json'))
        elif erc:
          how += f'; eval failed (rc {erc}, see eval.log)'
    if status == 'diverged':
      result = 'diverged'
    elif rc == 0 and status == 'done':
      result = 'done'
    elif children.signum:
      result = f'stopped (rc {rc})'
    else:
      result = f'failed (rc {rc})'
    return i, c, result, how, time.perf_counter() - start

  finished = {c['name']: threading.Event() for c in cells}
  outcome = {}

  def run_after_source(i, c):  # run_cell once the init_from source (started earlier) has finished
    try:
      if c.get('after') and (finished[c['after']].wait() and
                             outcome.get(c['after']) not in ('done', 'skipped')):
        return i, c, 'not started', f'init_from cell {c["after"]}: {outcome.get(c["after"])}', 0.0
      outcome[c['name']] = (result := run_cell(i, c))[2]
      return result
    finally:
      finished[c['name']].set()

  def report(i, c, result, how, seconds):
    results[c['name']] = result
    train_loss, valid_loss = _final_loss(paths.join(sweep_dir, c['name']))
    losses = ''
    if result in ('done', 'skipped', 'diverged') and train_loss is not None:
      losses = f'  train {train_loss:.4f}' + (f'  valid {valid_loss:.4f}' if valid_loss else '')
    where = ('' if result in ('done', 'skipped', 'not started')
             else f'  (log: {c["name"]}/train.log)')
    print(f'[{i + 1}/{n}] {c["name"]}: {result} ({how}, {seconds:.0f}s){losses}{where}',
          file=out, flush=True)

  with children.handling():
    if parallel <= 1:
      for i, c in enumerate(cells):
        report(*run_after_source(i, c))
    else:
      with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        futures = [pool.submit(run_after_source, i, c) for i, c in enumerate(cells)]
        for future in concurrent.futures.as_completed(futures):
          report(*future.result())
  done = sum(r in ('done', 'skipped') for r in results.values())
  if children.signum:
    name = signal.Signals(children.signum).name
    print(f'sweep: stopped by {name}: {done}/{n} cells finished, '
          f'{sum(r.startswith("stopped") for r in results.values())} stopped, '
          f'{sum(r == "not started" for r in results.values())} not started; rerun the same '
          'command to resume', file=out, flush=True)
    raise Stopped(children.signum, results)
  print(f'sweep: {done}/{n} cells finished in {sweep_dir}; compare with: python -m tools.compare '
        f'{shlex.quote(sweep_dir)} --out={shlex.quote(paths.join(sweep_dir, "compare.png"))}',
        file=out)
  return results


# --- The command line -----------------------------------------------------------------------------

FLAGS = flags.FLAGS
FINISHED = ('done', 'skipped', 'diverged', 'dry_run')  # results that leave nothing to rerun


def define_flags():
  """The CLI flags, defined only when run as a program (tests import this module)."""
  flags.DEFINE_string('sweep', None, 'The sweep file, configs/ablations/NAME.py[:ARG]; every cell '
                      'trains with train.py into --sweep_dir/<cell name>.')
  flags.DEFINE_string('sweep_dir', None, 'Directory of the sweep (local or gs://): one '
                      'workdir per cell.')
  flags.DEFINE_bool('dry_run', False, 'Print the train.py (and eval.py) command of every cell and '
                    'run nothing (for launching cells on a cluster).')
  flags.DEFINE_list('seeds', None, 'Seeds to run (default: the sweep file\'s).')
  flags.DEFINE_integer('parallel', 1, 'Cells run side by side, each on one XLA/OpenMP thread.')
  flags.DEFINE_bool('sweep_eval', False, 'Run the sweep file\'s eval.py flags on each finished '
                    'cell.')


def main(argv):
  """Exits 0 when every cell finished (done, skipped, diverged or dry run), 1 when one failed, 2 on
  a missing flag or a sweep file that cannot be expanded, 128 + N when signal N stopped it."""
  if len(argv) > 1:
    cli_checks.fail('sweep', f'unexpected arguments {argv[1:]}; valid: flags only')
  if not FLAGS.sweep or not FLAGS.sweep_dir:
    print('sweep: --sweep and --sweep_dir are required', file=sys.stderr)
    sys.exit(2)
  if FLAGS.parallel < 1:
    cli_checks.fail('sweep', f'--parallel={FLAGS.parallel} must be a positive integer')
  if paths.exists(FLAGS.sweep_dir) and not paths.isdir(FLAGS.sweep_dir):
    cli_checks.fail('sweep', f'--sweep_dir={FLAGS.sweep_dir} is a file; valid: a directory (the '
                    'cells train in its subdirectories)')
  try:
    results = run_sweep(FLAGS.sweep, FLAGS.sweep_dir, seeds=FLAGS.seeds, dry_run=FLAGS.dry_run,
                        parallel=FLAGS.parallel, run_eval=FLAGS.sweep_eval)
  except SweepError as e:
    cli_checks.fail('sweep error', e)
  except Stopped as e:
    sys.exit(128 + e.signum)  # the shell's convention for "ended by this signal"
  sys.exit(0 if all(r in FINISHED for r in results.values()) else 1)


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli_checks.flags_parser('sweep'))
