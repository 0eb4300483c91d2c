"""Statistics across seeds for tools.compare: each cell's mean with a 95% interval, and with a
baseline cell a permutation test, Holm's correction over the table and a verdict (`better`,
`worse` or `n.s.` at 5%) that cannot claim more than the seeds show.

- The interval: for an unbounded metric (losses, ratios) the Student t interval (t with n - 1
  degrees of freedom). For a bounded one (`bounded`: accuracy, retrieval, recall, all in [0, 1])
  Hesterberg's expanded percentile bootstrap (The American Statistician 69(4), 2015): the
  quantiles of the mean over RESAMPLES resamples of the seeds (fixed RNG seed: deterministic), at
  the tail a t interval would use, Phi(-sqrt(n / (n - 1)) t_{0.975, n-1}) (the plain percentile
  interval is too narrow at a few seeds). Resampled means lie within the seeds' range, so the
  interval stays inside [0, 1]; at 3 or 4 seeds it is about that range. None at 2 seeds or fewer
  (`n/a`). A bounded metric also counts its seeds at or above SOLVED: `3 (2 solved)`.
- The test (tools.compare.significance): paired by seed where both cells ran the same seeds
  (train.seed sets both the initialisation and the data order, so pairing removes what seed s of
  either cell shares), the exact sign-flip test on the differences; otherwise the exact
  two-sample permutation test (both with fixed-seed Monte Carlo beyond 2^16 arrangements). A
  difference with no spread gets the test's smallest p, never 0: 0.25 paired at 3 seeds.
- Holm's correction over every test of one table (all cells x metrics against the baseline);
  the verdict follows `p_holm`: `better`/`worse` by the metric's direction at p_holm < 5%, else
  `n.s.`, with the minimum detectable effect (`mde`: the approximate t-based difference found
  with 80% power at an uncorrected two-sided 5%, or `none reachable` where the seeds cannot reach
  5%). `n.s.` is never `level`: `significance.equivalent` (TOST at a stated margin) is the test
  for that. A cell with a single seed has no test (`n/a`).

Metrics (each with the direction that counts as better):
- final_valid: the last validation loss of the run (lower);
- from eval.json: loss.<split> (lower), accuracy.<split> (higher), the extrapolation ratios
  r2, r4, r8 (loss at kL / loss at L: lower), the loss by position loss_pos@<a-b> (positions a to
  b of the windows of the training length: lower), passkey retrieval@<length> (mean over depths:
  higher), mqar recall_pairs@<P> and recall_distance@<lo-hi> (higher).
"""

import datetime
import math
import os
import shlex
import subprocess
import sys

import numpy as np
from scipy import stats as scipy_stats

from training import paths as paths_lib
from tools.compare import extrapolation as extrapolation_compare
from tools.compare import significance

ALPHA = significance.ALPHA
LOWER_IS_BETTER = ('final_valid', 'loss.', 'r2', 'r4', 'r8', 'loss_L', 'loss_pos@')
# Scores in [0, 1], higher is better: bootstrap intervals and a count of solved seeds.
BOUNDED = ('accuracy.', 'retrieval@', 'recall_pairs@', 'recall_distance@')
# A seed solves a bounded metric at this score or above: the task done up to the odd example.
SOLVED = 0.99
RESAMPLES = 10_000  # of the bootstrap
SEED = 0  # of the bootstrap's resamples: the same values give the same interval
# The name callers and tests use for the cell-against-baseline test.
test = significance.test


def lower_is_better(metric: str) -> bool:
  return metric.startswith(LOWER_IS_BETTER)


def bounded(metric: str) -> bool:
  """Whether `metric` is a score in [0, 1] (accuracy, retrieval, recall)."""
  return metric.startswith(BOUNDED)


def interval(values, metric=None):
  """(mean, [lo, hi]): the 95% interval across seeds, [None, None] where there is none.

  Args:
    values: one value per seed.
    metric: its name; a `bounded` one gets `bootstrap_interval`, any other (or None) the t
      interval (None for fewer than two seeds).
  """
  if metric is not None and bounded(metric):
    return bootstrap_interval(values)
  values = np.asarray(values, np.float64)
  mean = float(np.mean(values))
  if len(values) < 2:
    return mean, [None, None]
  half = scipy_stats.t.ppf(1 - ALPHA / 2, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(
      len(values))
  return mean, [float(mean - half), float(mean + half)]


def bootstrap_interval(values):
  """(mean, [lo, hi]): the 95% expanded percentile bootstrap interval of the mean (inside the
  values' range), [None, None] for two seeds or fewer."""
  values = np.asarray(values, np.float64)
  mean, n = float(np.mean(values)), len(values)
  if n <= 2:  # 2 seeds have 3 distinct resampled means: no 95% interval
    return mean, [None, None]
  # The plain percentile interval ignores that the spread is estimated from n values: take the
  # tail at which a normal reaches as far as the t interval, widened by sqrt(n / (n - 1)) for the
  # bootstrap's divisor n (Hesterberg 2015).
  tail = scipy_stats.norm.cdf(-math.sqrt(n / (n - 1)) * scipy_stats.t.ppf(1 - ALPHA / 2, n - 1))
  means = values[np.random.default_rng(SEED).integers(0, n, (RESAMPLES, n))].mean(1)
  # A resample of one value repeated can average a last bit beyond it: keep to the values' range.
  lo, hi = np.clip(np.quantile(means, [tail, 1 - tail]), values.min(), values.max())
  return mean, [float(lo), float(hi)]


def solved(metric, values):
  """How many seeds reach SOLVED on a `bounded` metric; None for another."""
  return int(np.sum(np.asarray(values) >= SOLVED)) if bounded(metric) else None


def verdict(metric, mean, base_mean, p):
  """'better' / 'worse' (p < 5%, by the metric's direction), 'n.s.', or 'n/a' (no test); `p` is
  the Holm-adjusted one in a table."""
  if p is None:
    return 'n/a'
  if p >= ALPHA:
    return 'n.s.'
  lower = mean < base_mean
  return 'better' if lower == lower_is_better(metric) else 'worse'


# --- The metrics of each run ----------------------------------------------------------------------

def run_metrics(run):
  """{metric: value} of one run (tools.compare.runs record): its final validation loss and what its
  eval.json holds."""
  out = {}
  _, valid = run['valid']
  if len(valid) and math.isfinite(valid[-1]):
    out['final_valid'] = float(valid[-1])
  result = extrapolation_compare.load_eval(run['workdir']) or {}
  for kind in ('loss', 'accuracy'):
    for split, value in (result.get(kind) or {}).items():
      out[f'{kind}.{split}'] = float(value)
  if result.get('extrapolation'):
    for name, value in extrapolation_compare.run_metrics(result).items():
      if value is not None and (name.startswith('r') or name == 'loss_L'):
        out[name] = float(value)
    out.update(extrapolation_compare.position_losses(result))
  for length, by_depth in (result.get('retrieval') or {}).items():
    out[f'retrieval@{length}'] = float(np.mean(list(by_depth.values())))
  recall = result.get('recall') or {}
  for pairs, value in (recall.get('by_pairs') or {}).items():
    out[f'recall_pairs@{pairs}'] = float(value)
  for bucket, value in (recall.get('by_distance') or {}).items():
    out[f'recall_distance@{bucket}'] = float(value)
  return out


def _seed(run):
  seed = (run.get('config') or {}).get('train.seed')
  return None if seed is None else int(seed)


def cell_stats(groups, baseline=None):
  """{cell: {metric: entry}} of every group (a metric that not every seed of a cell has is left out
  of that cell), each entry {'mean', 'ci95', 'n', 'solved', 'p', 'p_holm', 'test', 'verdict',
  'mde'}: 'solved' for a `bounded` metric only; the rest against `baseline` (a group label),
  None without one. Holm's correction runs over every test of the result, and the verdict follows
  its 'p_holm'.

  Raises:
    ValueError: `baseline` is not a cell's label (one line with the valid labels).
  """
  labels = [label for label, _ in groups]
  if baseline is not None and baseline not in labels:
    raise ValueError(f'--baseline={baseline!r} is not a cell of this comparison; valid: '
                     f'{", ".join(labels)}')
  per_cell = {}
  for label, runs in groups:
    metrics = [run_metrics(r) for r in runs]
    names = [m for m in metrics[0] if all(m in other for other in metrics)]
    seeds = [_seed(r) for r in runs]
    per_cell[label] = {name: ([m[name] for m in metrics], None if None in seeds else seeds)
                       for name in names}
  out = {}
  for label, by_metric in per_cell.items():
    out[label] = {}
    for name, (values, seeds) in by_metric.items():
      base = per_cell[baseline].get(name) if baseline not in (None, label) else None
      out[label][name] = _entry(name, values, seeds, base)
      if label == baseline:
        out[label][name]['verdict'] = 'baseline'
  if baseline is not None:
    _correct(out, baseline)
  return out


def _entry(name, values, seeds, base):
  """One cell's entry for metric `name`; tested against `base` ((values, seeds) or None)."""
  mean, ci = interval(values, name)
  entry = {'mean': mean, 'ci95': ci, 'n': len(values), 'solved': solved(name, values),
           'p': None, 'p_holm': None, 'test': None, 'verdict': None, 'mde': None}
  if base is not None:
    p, kind = test(values, seeds, *base)
    entry.update(p=p, test=kind, mde=significance.mde(values, seeds, *base))
  return entry


def _correct(stats, baseline):
  """Adds Holm's 'p_holm' to every tested entry of `stats` (one family: the whole table) and the
  verdict it gives."""
  tested = [(label, name) for label, by_metric in stats.items() for name, entry in by_metric.items()
            if entry['test'] is not None]
  adjusted = significance.holm([stats[label][name]['p'] for label, name in tested])
  for (label, name), p_holm in zip(tested, adjusted):
    entry = stats[label][name]
    entry['p_holm'] = p_holm
    entry['verdict'] = verdict(name, entry['mean'], stats[baseline][name]['mean'], p_holm)


def fmt_interval(entry, digits=4):
  """'mean [lo, hi]' (the 95% interval), or the mean alone where there is none."""
  lo, hi = entry['ci95']
  if lo is None:
    return f'{entry["mean"]:.{digits}f}'
  return f'{entry["mean"]:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]'


def fmt_verdict(entry, digits=4):
  """The verdict, an `n.s.` with its minimum detectable effect: 'n.s. (MDE 0.0123)' or
  'n.s. (none reachable at 3 seeds)'; '-' for none."""
  if entry['verdict'] != 'n.s.' or entry['mde'] is None:
    return entry['verdict'] or '-'
  if entry['mde'] == significance.NONE_REACHABLE:
    return f'n.s. (none reachable at {entry["n"]} seeds)'
  return f'n.s. (MDE {entry["mde"]:.{digits}g})'


def markdown(stats, baseline):
  """| metric | cell | mean [95% CI] | seeds | p | p Holm | verdict |: a row per metric and cell,
  metric after metric."""
  head = ['metric', 'cell', 'mean [95% CI]', 'seeds', 'p', 'p Holm',
          f'vs {baseline}' if baseline else 'verdict']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  names = list(dict.fromkeys(name for by_metric in stats.values() for name in by_metric))
  for name in names:
    for label, by_metric in stats.items():
      if name not in by_metric:
        continue
      entry = by_metric[name]
      p = '-' if entry['p'] is None else f'{entry["p"]:.3g} ({entry["test"]})'
      p_holm = '-' if entry['p_holm'] is None else f'{entry["p_holm"]:.3g}'
      seeds = str(entry['n']) + ('' if entry['solved'] is None else f' ({entry["solved"]} solved)')
      lines.append('| ' + ' | '.join([name, label, fmt_interval(entry), seeds, p, p_holm,
                                      fmt_verdict(entry)]) + ' |')
  note = ('Mean and 95% interval across seeds: Student t (n-1 degrees of freedom); for accuracy, '
          'retrieval and recall, in [0, 1], the expanded percentile bootstrap (none at 2 seeds or '
          f'fewer), with the seeds scoring at least {SOLVED} (solved). ')
  if baseline:
    note += (f'p: two-sided permutation test against {baseline}: paired by seed where both cells '
             'ran the same seeds (train.seed sets the initialisation and the data order), the '
             'exact sign-flip test (smallest p at 3 seeds: 0.25), else the two-sample '
             "permutation test; p Holm: Holm's correction over every p of this table. "
             'better/worse at p Holm < 0.05 by the metric\'s direction (loss, final_valid, r_k: '
             'lower; accuracy, retrieval, recall: higher), else n.s. (not separable, not equal), '
             'with the approximate difference found with 80% power at 5% (MDE), or none reachable '
             'where the seeds cannot reach 5%; n/a: a cell with one seed.')
  return '\n'.join(lines + ['', note])


def stats_path(out):
  """`<out stem>_stats.json` beside the comparison's picture."""
  return (out[:-4] if out.endswith('.png') else out) + '_stats.json'


def about(baseline):
  """What produced the numbers: the baseline, the commit (None outside a git checkout), the UTC
  date and the command."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=root, capture_output=True,
                            text=True, timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    commit = None
  return {'baseline': baseline, 'commit': commit,
          'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          'command': shlex.join([os.path.basename(sys.executable)] + sys.argv)}


def write(stats, out, baseline=None):
  """Writes `{"about": about(baseline), "cells": stats}` beside `out`; returns its path."""
  path = stats_path(out)
  paths_lib.makedirs(paths_lib.dirname(paths_lib.absolute(path)))
  paths_lib.write_json(path, {'about': about(baseline), 'cells': stats})
  return path
