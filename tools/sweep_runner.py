"""The sweep runner: every cell of a sweep file trained (or printed), side by side or in turn.

The sweep file's format and the command line are in tools/sweep.py; a cell's run in
tools/sweep_cells.py; the processes and the signals forwarded to them in tools/processes.py.
"""

import concurrent.futures
import os
import shlex
import signal
import sys
import threading

from training import paths
from tools import processes
from tools import sweep_cells
from tools import sweep_spec

FINISHED = ('done', 'skipped')  # results of a cell whose training is complete


class Stopped(Exception):
  """SIGINT or SIGTERM stopped the sweep: running cells saved and stopped, later ones never
  began."""

  def __init__(self, signum, results):
    super().__init__(f'sweep: stopped by {signal.Signals(signum).name}')
    self.signum, self.results = signum, results


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
    children: the `tools.processes.Children` whose signal stops the sweep (default a new one,
      which forwards SIGINT and SIGTERM to the running cells while the sweep runs).

  Returns:
    {cell name: status}, status one of done | skipped | diverged | failed (rc N) | dry_run.

  Raises:
    Stopped: a SIGINT or SIGTERM arrived; the cells it reached have saved and stopped (status
      'stopped (rc N)'), later ones never started ('not started'); `results` holds every status.
  """
  children = children or processes.Children()
  path, arg = sweep_spec.split_spec(spec)
  module = sweep_spec.load_sweep_module(path)
  sweep = sweep_spec.get_sweep(module, arg)
  cells = sweep_spec.expand(sweep, seeds)
  # Validate every cell before the first one runs: a typo in the last cell should not surface
  # after hours of the others.
  steps = {c['name']: sweep_spec.cell_config(module, arg, c).train.steps for c in cells}
  if dry_run:
    return _print_commands(spec, sweep, sweep_dir, cells, out)

  paths.makedirs(sweep_dir)
  ctx = sweep_cells.Context(
      # Cells run from the repository root: give them absolute paths.
      spec=os.path.abspath(path) + (f':{arg}' if arg else ''),
      sweep=sweep,
      sweep_dir=paths.absolute(sweep_dir),
      launch=launch or children.launch,
      env=sweep_cells.single_thread_env() if parallel > 1 else dict(os.environ),
      children=children,
      run_eval=run_eval)
  results = {}

  def report(i, cell, outcome):
    results[cell['name']] = outcome.result
    print(_progress_line(i, len(cells), cell, outcome, ctx.sweep_dir), file=out, flush=True)

  def run(cell):
    return sweep_cells.run_cell(ctx, cell, steps[cell['name']])

  with children.handling():
    _run_all(cells, parallel, run, report)
  _print_summary(results, len(cells), ctx.sweep_dir, children.signum, out)
  return results


def _print_commands(spec, sweep, sweep_dir, cells, out):
  """--dry_run: each cell's train.py command and its eval.py commands."""
  for cell in cells:
    print(shlex.join(sweep_spec.train_command(spec, sweep_dir, cell)), file=out)
    for _, argv in sweep_spec.eval_commands(sweep, sweep_dir, cell):
      print(shlex.join(argv), file=out)
  return {cell['name']: 'dry_run' for cell in cells}


def _run_all(cells, parallel, run, report):
  """Calls `run(cell)` for every cell, `parallel` at a time, and `report(i, cell, outcome)` as
  each ends (in order when one at a time).

  A cell started from another's parameters (its 'after': a train.init_from source listed before
  it) waits for that cell to end and is not started unless it finished.
  """
  ended = {cell['name']: threading.Event() for cell in cells}
  results = {}  # cell name -> result, of the cells that ran

  def run_after_source(i, cell):
    try:
      source = cell.get('after')
      if source:
        ended[source].wait()
        if results.get(source) not in FINISHED:
          return i, cell, sweep_cells.Outcome(
              'not started', f'init_from cell {source}: {results.get(source)}')
      outcome = run(cell)
      results[cell['name']] = outcome.result
      return i, cell, outcome
    finally:
      ended[cell['name']].set()

  if parallel <= 1:
    for i, cell in enumerate(cells):
      report(*run_after_source(i, cell))
    return
  # The pool starts cells in order, so a source has started before any cell that waits for it.
  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    futures = [pool.submit(run_after_source, i, cell) for i, cell in enumerate(cells)]
    for future in concurrent.futures.as_completed(futures):
      report(*future.result())


def _progress_line(i, n, cell, outcome, sweep_dir):
  """'[3/9] NAME: done (new, 42s)  train 2.1000  valid 2.3000', with the log of a failed cell."""
  train_loss, valid_loss = sweep_cells.final_losses(paths.join(sweep_dir, cell['name']))
  losses = ''
  if outcome.result in ('done', 'skipped', 'diverged') and train_loss is not None:
    losses = f'  train {train_loss:.4f}'
    if valid_loss:
      losses += f'  valid {valid_loss:.4f}'
  where = ''
  if outcome.result not in ('done', 'skipped', 'not started'):
    where = f'  (log: {cell["name"]}/train.log)'
  return (f'[{i + 1}/{n}] {cell["name"]}: {outcome.result} ({outcome.how}, '
          f'{outcome.seconds:.0f}s){losses}{where}')


def _print_summary(results, n, sweep_dir, signum, out):
  """The sweep's last line: how to compare the cells, or (raising Stopped) what a signal left."""
  done = sum(r in FINISHED for r in results.values())
  if signum:
    stopped = sum(r.startswith('stopped') for r in results.values())
    not_started = sum(r == 'not started' for r in results.values())
    print(f'sweep: stopped by {signal.Signals(signum).name}: {done}/{n} cells finished, '
          f'{stopped} stopped, {not_started} not started; rerun the same command to resume',
          file=out, flush=True)
    raise Stopped(signum, results)
  compare_png = paths.join(sweep_dir, 'compare.png')
  print(f'sweep: {done}/{n} cells finished in {sweep_dir}; compare with: python -m tools.compare '
        f'{shlex.quote(sweep_dir)} --out={shlex.quote(compare_png)}', file=out)
