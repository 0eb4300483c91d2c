"""`compare`: train.py runs drawn and tabulated (the command line: tools/compare/__main__.py)."""

import numpy as np

from training import paths as paths_lib  # local or gs:// (the arguments are `paths` here)
from tools.compare import figure as compare_figure
from tools.compare import curves as curves_lib
from tools.compare import extrapolation as extrapolation_compare
from tools.compare import ladder as ladder_lib
from tools.compare import metrics as metric_compare
from tools.compare import retrieval as retrieval_compare
from tools.compare import runs as runs_lib
from tools.compare import stats as stats_lib
from tools.compare import stats_figure
from tools.compare import summary as summary_lib
from tools.compare import summary_table
from tools.compare import tune_table


def compare(paths, out, *, smoothing=None, logy=False, logx=False, target_loss=None,
            target_split='valid', color_by=None, style_by=None, band_kind='minmax', metrics=(),
            baseline=None):
  """Loads the runs under `paths`, draws `out` (PNG) and returns the markdown summary table.

  Args:
    paths: workdirs and sweep directories.
    out: the PNG to write.
    smoothing: the train curves' `tools.compare.curves.smooth` spec.
    logy: log-scale loss axes.
    logx: log-scale step axes.
    target_loss: tabulate the first logged step at which the loss reaches this.
    target_split: the loss `target_loss` is read from: 'valid' or 'train'.
    color_by: the field that picks the hue (None: `tools.compare.group_styles.rank_fields`'s first;
      'none': one per group).
    style_by: the field that picks the line style (None: automatic; 'none': solid lines).
    band_kind: the spread across seeds: 'minmax', 'std' or 'none'.
    metrics: logged training metrics beside the loss to draw over training into OUT_metrics.png
      and tabulate (`tools.compare.metrics`).
    baseline: a cell's label: every other cell is tested against it (`tools.compare.stats`).

  Returns:
    The runs left out, each with why (a run still training, a damaged metrics.jsonl), then the
    markdown table, the groups labelled with their full overrides (then, for a tuned sweep,
    the tuning table of `tools.compare.tune_table`; for runs with eval.json extrapolation rows,
    `extrapolation_compare`'s table; for passkey runs with a retrieval report,
    `retrieval_compare`'s; with `metrics`, `metric_compare`'s; then `tools.compare.stats`' table,
    whose numbers are written to OUT_stats.json; for a ladder sweep, `tools.compare.ladder`'s
    table against `baseline`, a variant, with OUT_ladder.json and OUT_ladder.png).
  """
  runs, left_out = runs_lib.load_runs(paths)
  # A tuned sweep (tools.sweep --tune): each cell at its chosen value; the tuning runs at the
  # other values go to their own table.
  choices = tune_table.read_choices(paths)
  runs = tune_table.split_runs(runs, choices)
  # Reject a bad --smooth or --band before any work.
  curves_lib.smooth(np.zeros(1), smoothing)
  curves_lib.band([(np.zeros(1), np.zeros(1))], band_kind)
  groups = summary_lib.group_runs(runs)
  summary = summary_lib.summarize(groups, target_loss, target_split)
  # A ladder sweep's --baseline names a variant (tools.compare.ladder), not a table cell.
  ladder = bool(ladder_lib.read_index(paths))
  table_baseline = None if ladder else baseline
  stats = stats_lib.cell_stats(groups, table_baseline)  # a bad --baseline before any drawing
  ladder_part = ladder_lib.report(runs, paths, out, baseline) if ladder else ''
  for row in summary:
    row['verdict'] = stats[row['label']].get('final_valid', {}).get('verdict')
  metric_compare.check_metrics(groups, metrics)  # a bad --metrics before any drawing
  compare_figure.plot(groups, summary, out, smoothing=smoothing, logy=logy, logx=logx,
                      title=_title(paths, len(runs), len(groups)), color_by=color_by,
                      style_by=style_by, band_kind=band_kind)
  # Runs evaluated with eval.py --lengths: their table, and their loss per position drawn into
  # OUT_extrapolation.png.
  extrapolation = extrapolation_compare.report(groups, out, band_kind)
  # Passkey runs evaluated with eval.py: their accuracy by length, heat maps in OUT_retrieval.png.
  retrieval = retrieval_compare.report(groups, out)
  table = summary_table.markdown_table(summary, target_loss, target_split)
  tuning = tune_table.markdown(choices, groups)
  logged = metric_compare.report(groups, summary, out, metrics, color_by=color_by,
                                 style_by=style_by, band_kind=band_kind)
  stats_lib.write(stats, out, table_baseline)
  drawn = stats_figure.draw(stats, out, table_baseline)
  tested = (f'Statistics (numbers in {stats_lib.stats_path(out)}'
            + (f'; picture: {drawn}' if drawn else '') + '):\n\n'
            + stats_lib.markdown(stats, table_baseline))
  return '\n\n'.join(part for part in (_left_out(left_out), table, tuning, extrapolation,
                                       retrieval, logged, tested, ladder_part)
                     if part)


def _left_out(left_out):
  """'Left out: 2 runs.' and a line for each, naming the run and why."""
  if not left_out:
    return ''
  return '\n'.join([f'Left out: {len(left_out)} run{"s" if len(left_out) > 1 else ""} (the '
                     'statistics count the seeds of the others).']
                    + [f'- {paths_lib.basename(w)}: {why}' for w, why in left_out])


def _title(paths, num_runs, num_groups):
  """'sw: 18 runs in 9 cells'; the arguments' names left out when they are long."""
  names = ', '.join(paths_lib.basename(p) for p in paths)
  title = f'{names}: ' if len(names) <= 60 else ''
  if num_groups > 1:
    return f'{title}{num_runs} runs in {num_groups} cells'
  return f'{title}{num_runs} runs'
