"""The sweep runner: every cell of a sweep file trained (or printed), side by side or in turn.

The sweep file's format and the command line are in tools/sweep/__main__.py; a cell's run in
tools/sweep/cells.py; the processes and the signals forwarded to them in tools/sweep/processes.py.
"""

import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import shlex
import signal
import socket
import sys
import tempfile

from training import config_file
from training import lock
from training import paths
from tools.sweep import processes
from tools.sweep import cells as sweep_cells
from tools.sweep import ladder as sweep_ladder
from tools.sweep import spec as sweep_spec
from tools.sweep import tune as sweep_tune

FINISHED = ('done', 'skipped')  # results of a cell whose training is complete


class Stopped(Exception):
  """SIGINT or SIGTERM stopped the sweep: running cells saved and stopped, later ones never
  began."""

  def __init__(self, signum, results):
    super().__init__(f'sweep: stopped by {signal.Signals(signum).name}')
    self.signum, self.results = signum, results


class SweepBusy(Exception):
  """Another runner is running a sweep in the same --sweep_dir."""


def lock_path(sweep_dir):
  """The lock file of a local sweep folder: in the temp dir, not in the folder, whose entries are
  the cells (as text_corpus keeps a preparation's lock out of data_dir)."""
  key = hashlib.sha256(os.path.abspath(sweep_dir).encode()).hexdigest()[:16]
  return os.path.join(tempfile.gettempdir(), f'attnlab-sweep-{key}.lock')


@contextlib.contextmanager
def sweep_lock(sweep_dir):
  """Held for the sweep: a second runner in the same folder is refused at once instead of
  starting the same cells and rewriting the same tune.json beside the first. A local folder's is
  an `fcntl.flock` (the kernel drops it when the runner dies, however it dies) on `lock_path`
  holding 'PID HOST'; a gs:// folder's the object lock of `training.lock` in it."""
  if paths.is_remote(sweep_dir):
    try:
      with lock.WorkdirLock(sweep_dir):
        yield
      return
    except lock.WorkdirBusy as e:
      holder = str(e).split(' is in use by ', 1)[-1].split(' (lock ', 1)[0]
      raise _busy(sweep_dir, holder) from None
  fd = os.open(lock_path(sweep_dir), os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    holder = os.pread(fd, 200, 0).decode(errors='replace').split()
    os.close(fd)
    raise _busy(sweep_dir, f'PID {holder[0]} on {holder[1]}' if len(holder) >= 2
                else 'another process') from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f'{os.getpid()} {socket.gethostname()}\n'.encode(), 0)
  try:
    yield
  finally:
    os.ftruncate(fd, 0)
    os.close(fd)  # releases the lock


def _busy(sweep_dir, holder):
  return SweepBusy(f'--sweep_dir={sweep_dir} is in use by another sweep runner ({holder}); wait '
                   'for it to end (rerun this command then to resume) or use another --sweep_dir')


def run_sweep(spec, sweep_dir, *, seeds=None, dry_run=False, parallel=1, run_eval=False,
              tune=None, tune_tolerance=None, launch=None, out=sys.stdout, children=None):
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
    tune: None, or `FIELD:V1,V2,...`: each cell at every value with the first seed, its other
      seeds at the value with the lowest final validation loss (tools/sweep/tune.py), the choices
      recorded in `sweep_dir/tune.json`.
    tune_tolerance: the tuning choice's tolerance in nats (None: `sweep_tune.TOLERANCE`).
    launch: `launch(argv, log_path, env) -> exit code` (tests replace it); default
      `children.launch`.
    children: the `tools.sweep.processes.Children` whose signal stops the sweep (default a new one,
      which forwards SIGINT and SIGTERM to the running cells while the sweep runs).

  Returns:
    {cell name: status}, status one of done | skipped | diverged | failed (rc N) | dry_run.

  Raises:
    SweepError: a sweep file or a --tune that cannot be expanded (before anything runs).
    Stopped: a SIGINT or SIGTERM arrived; the cells it reached have saved and stopped (status
      'stopped (rc N)'), later ones never started ('not started'); `results` holds every status.
    SweepBusy: another runner holds `sweep_dir` (its lock), before anything runs.
  """
  children = children or processes.Children()
  path, arg = config_file.split_spec(spec)
  module = sweep_spec.load_sweep_module(path)
  sweep = sweep_spec.get_sweep(module, arg)
  cells, tunings, axis = sweep_spec.expand(sweep, seeds), [], None
  if tune is not None:
    axis = sweep_tune.parse(tune, module, arg, sweep, sweep_tune.TOLERANCE
                            if tune_tolerance is None else tune_tolerance)
    cells, tunings = sweep_tune.plan(cells, axis)
  # Validate every cell before the first one runs: a typo in the last cell should not surface
  # after hours of the others. (A tuned cell's other seeds differ from its tuning runs in the
  # seed alone.)
  configs = {c['name']: sweep_spec.cell_config(module, arg, c) for c in cells
             if not c.get('tuning')}
  steps = {name: config.train.steps for name, config in configs.items()}
  for cell in cells:
    cell['steps'] = steps.get(cell['name'])  # a ladder cell's matched train.steps
  if dry_run:
    results = _print_commands(spec, sweep, sweep_dir, cells, steps, out)
    rows = [sweep_ladder.row(configs[c['name']], c) for c in cells
            if sweep_ladder.is_ladder(c) and c['name'] in configs]
    if rows:
      print(sweep_ladder.table(rows), file=out)
    return results

  paths.makedirs(sweep_dir)
  with sweep_lock(sweep_dir):
    sweep_ladder.write_index(sweep_dir, sweep, cells)
    return _run_cells(spec, path, arg, module, sweep, sweep_dir, cells, tunings, axis, steps,
                      parallel, run_eval, launch, out, children)


def _run_cells(spec, path, arg, module, sweep, sweep_dir, cells, tunings, axis, steps, parallel,
               run_eval, launch, out, children):
  """`run_sweep`'s runs, under the sweep's lock."""
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
  tuner = sweep_tune.Tuner(ctx.sweep_dir, axis, tunings, steps, out) if axis else None
  if tuner:
    tuner.start()

  def report(i, cell, outcome):
    results[cell['name']] = outcome.result
    print(_progress_line(i, len(cells), cell, outcome, ctx.sweep_dir), file=out, flush=True)
    if tuner:
      tuner.ended(cell, results)

  def run(cell):
    if cell['name'] not in steps:  # a tuned cell's other seed: as its tuning run at that value
      steps[cell['name']] = sweep_spec.cell_config(module, arg, cell).train.steps
    cell['steps'] = steps[cell['name']]
    return sweep_cells.run_cell(ctx, cell, steps[cell['name']])

  with children.handling():
    _run_all(cells, parallel, run, report)
  _print_summary(results, len(cells), ctx.sweep_dir, children.signum, out, bool(tuner))
  return results


def _print_commands(spec, sweep, sweep_dir, cells, steps, out):
  """--dry_run: each cell's train.py command and its eval.py commands; a tuned cell's other seeds
  once its tuning runs have ended in `sweep_dir` (before that, a comment line)."""
  results = {}
  for cell in cells:
    if cell.get('tuning'):
      cell, waits = cell['tuning'].resolve_on_disk(cell, sweep_dir, steps)
      if waits:
        print(f'# {cell["name"]}: {waits}', file=out)
        results[cell['name']] = 'dry_run'
        continue
      # A ladder cell's steps do not depend on the tuned value or the seed: its tuning run's.
      stem = cell['name'].rsplit(',seed=', 1)[0]
      cell['steps'] = next((n for k, n in steps.items() if k.rsplit(',seed=', 1)[0] == stem),
                           None)
    print(shlex.join(sweep_spec.train_command(spec, sweep_dir, cell)), file=out)
    for _, argv in sweep_spec.eval_commands(sweep, sweep_dir, cell):
      print(shlex.join(argv), file=out)
    results[cell['name']] = 'dry_run'
  return results


def _waits_for(cell):
  """The cells that must end before `cell` starts: its train.init_from source, or, for a tuned
  cell's other seed, the cell's tuning runs."""
  if cell.get('tuning'):
    return cell['tuning'].runs
  return [cell['after']] if cell.get('after') else []


def _resolve(cell, results):
  """(the cell to run, None), or (cell, the Outcome of a cell that cannot start): its
  train.init_from source did not finish, or its tuning chose no value."""
  source = cell.get('after')
  if source and results.get(source) not in FINISHED:
    return cell, sweep_cells.Outcome('not started', f'init_from cell {source}: '
                                     f'{results.get(source)}')
  if cell.get('tuning'):
    cell, why = cell['tuning'].resolve(cell)
    if why:
      return cell, sweep_cells.Outcome('not started', why)
  return cell, None


def _run_all(cells, parallel, run, report):
  """Calls `run(cell)` for every cell, `parallel` at a time, and `report(i, cell, outcome)` as
  each ends.

  A cell starts once the cells it waits for (`_waits_for`) have ended, the first such cell in the
  list's order whenever a slot is free (so other cells run while one waits); one that cannot start
  (`_resolve`) is reported 'not started' at once.
  """
  results, waiting = {}, list(enumerate(cells))

  def end(i, cell, outcome):
    results[cell['name']] = outcome.result
    report(i, cell, outcome)

  def take():
    """The next (i, cell) that can run now (None: none yet), ending those that never can."""
    while True:
      item = next((w for w in waiting if all(n in results for n in _waits_for(w[1]))), None)
      if item is None:
        return None
      waiting.remove(item)
      cell, outcome = _resolve(item[1], results)
      if outcome is None:
        return item[0], cell
      end(item[0], cell, outcome)

  if parallel <= 1:
    while (item := take()) is not None:
      end(*item, run(item[1]))
  else:
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
      running = {}
      while True:
        while len(running) < parallel and (item := take()) is not None:
          running[pool.submit(run, item[1])] = item
        if not running:
          break
        done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in done:
          end(*running.pop(future), future.result())
  for i, cell in waiting:  # waits for a cell that is not in the sweep: cannot happen
    end(i, cell, sweep_cells.Outcome('not started', f'waits for {_waits_for(cell)}'))


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


def _print_summary(results, n, sweep_dir, signum, out, tuned=False):
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
  choices = f' (the tuned values: {paths.join(sweep_dir, sweep_tune.CHOICE_FILE)})' if tuned else ''
  print(f'sweep: {done}/{n} cells finished in {sweep_dir}{choices}; compare with: python -m '
        f'tools.compare {shlex.quote(sweep_dir)} --out={shlex.quote(compare_png)}', file=out)
