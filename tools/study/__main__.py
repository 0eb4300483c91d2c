"""A study in one command: its sweep, its evaluations and its comparison against its baseline.

    python -m tools.study configs/ablations/NAME.py[:FORM] --dir=DIR [--seeds=0,1] [--parallel=N]
    python -m tools.study --list

FORM is a form the file's STUDY declares (smoke, full, ...; tools/study/declared.py) or any
argument its sweep takes (quick). The cells train and evaluate as `tools.sweep --sweep_eval` runs
them (finished cells are skipped, interrupted ones resume: rerun the same command), then
`tools.compare DIR --baseline=<the study's baseline cell>` writes DIR/compare.txt, its pictures and
DIR/compare_stats.json; the command ends with the headline metrics' table and the pictures' paths.
"""

import glob
import json
import sys

from absl import app
from absl import flags

from training import config_file
from training import paths
from tools.compare import comparison
from tools.compare import stats as stats_lib
from tools.compare import summary as summary_lib
from tools.compare import runs as runs_lib
from tools.study import declared
from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string('dir', None, 'The study\'s directory: one workdir per cell, and the '
                      'comparison (compare.txt, compare*.png, compare_stats.json).')
  flags.DEFINE_list('seeds', None, 'Seeds to run (default: the study file\'s).')
  flags.DEFINE_integer('parallel', 1, 'Cells run side by side, each on one XLA/OpenMP thread.')
  flags.DEFINE_bool('list', False, 'Print every study file with its forms, their cost, its page '
                    'and its baseline, and run nothing.')


def baseline_label(study_dir, cell):
  """The comparison table's label of the group holding the cell named `cell` (its runs' names
  are `cell,seed=N`), or None when no run of it is in `study_dir`."""
  if cell is None:
    return None
  runs, _ = runs_lib.load_runs([study_dir])
  for label, members in summary_lib.group_runs(runs):
    if any(run['name'].rsplit(',seed=', 1)[0] == cell for run in members):
      return label
  return None


def headline(stats, metrics):
  """The study's headline metrics from tools.compare's statistics: one markdown row per cell and
  metric (mean [95% interval], verdict against the baseline, Holm-adjusted p)."""
  lines = ['| metric | cell | mean [95% CI] | vs baseline | p (Holm) |', '|---|---|---|---|---|']
  for metric in metrics:
    for cell, entries in stats.items():
      entry = entries.get(metric)
      if entry is None:
        continue
      lo, hi = entry.get('ci95') or (None, None)
      interval = '' if lo is None else f' [{lo:.4g}, {hi:.4g}]'
      p = entry.get('p_holm')
      lines.append(f'| {metric} | {cell} | {entry["mean"]:.4g}{interval} | '
                   f'{entry.get("verdict") or "-"} | {"-" if p is None else f"{p:.3g}"} |')
  return '\n'.join(lines)


def run_study(spec, study_dir, *, seeds=None, parallel=1, out=sys.stdout):
  """Sweep, evaluation and comparison of the study file `spec` ('path[:FORM]'); returns the
  headline table. Raises StudyError or SweepError before anything runs, RuntimeError naming the
  cells that failed."""
  path, form = config_file.split_spec(spec)
  module = sweep_spec.load_sweep_module(path)
  study = declared.read(module)
  arg = declared.form_arg(study, form)
  sweep = sweep_spec.get_sweep(module, arg)
  named = next((n for n, (a, *_) in study['forms'].items() if n == form or (a or None) == arg),
               form)
  cell = declared.baseline_cell(declared.baseline_of(study, named),
                                sweep_spec.expand(sweep, seeds))  # before any training
  sweep_spec_text = path if arg is None else f'{path}:{arg}'
  results = sweep_runner.run_sweep(sweep_spec_text, study_dir, seeds=seeds, parallel=parallel,
                                   run_eval=True, out=out)
  failed = sorted(name for name, status in results.items() if status.startswith('failed'))
  if failed:
    raise RuntimeError(f'{len(failed)} cells failed ({", ".join(failed)}); see each cell\'s '
                       'train.log, then rerun the same command')
  label = baseline_label(study_dir, cell)
  png = paths.join(study_dir, 'compare.png')
  table = comparison.compare([study_dir], png, baseline=label)
  with open(paths.join(study_dir, 'compare.txt'), 'w') as f:
    f.write(table + '\n')
  stats_path = stats_lib.stats_path(png)
  with open(stats_path) as f:
    stats = json.load(f)['cells']
  head = headline(stats, study['metrics'])
  pictures = sorted(glob.glob(paths.join(study_dir, 'compare*.png')))
  print(f'\nbaseline: {label or "none"}; the whole comparison: '
        f'{paths.join(study_dir, "compare.txt")}\n\n{head}\n\npictures: ' + ', '.join(pictures),
        file=out)
  return head


def main(argv):
  if FLAGS.list:
    print(declared.listing())
    return
  if len(argv) != 2 or not FLAGS.dir:
    print('study: usage: python -m tools.study configs/ablations/NAME.py[:FORM] --dir=DIR '
          '(or --list)', file=sys.stderr)
    sys.exit(2)
  try:
    run_study(argv[1], FLAGS.dir, seeds=FLAGS.seeds, parallel=FLAGS.parallel)
  except (declared.StudyError, sweep_spec.SweepError) as e:
    print(f'study: {e}', file=sys.stderr)
    sys.exit(2)
  except RuntimeError as e:
    print(f'study: {e}', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  app.run(main)
