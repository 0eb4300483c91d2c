"""Statistics across seeds for tools.compare: each cell's mean with a 95% t interval, and with a
baseline cell a two-sided t-test and a verdict (`better`, `worse` or `n.s.` at 5%).

The test pairs the seeds (a paired t-test on the per-seed differences) when the two cells ran the
same seeds: train.seed sets both the initialisation and the data order, so seed s of one cell and
seed s of the other share both, and pairing removes what they share from the noise. Otherwise it
is Welch's t-test (unequal variances). A cell with a single seed has no interval and no test
(`n/a`).

Metrics (each with the direction that counts as better):
- final_valid: the last validation loss of the run (lower);
- from eval.json: loss.<split> (lower), accuracy.<split> (higher), the extrapolation ratios
  r2, r4, r8 (loss at kL / loss at L: lower), the loss by position loss_pos@<a-b> (positions a to
  b of the windows of the training length: lower), passkey retrieval@<length> (mean over depths:
  higher), mqar recall_pairs@<P> and recall_distance@<lo-hi> (higher).
"""

import math

import numpy as np
from scipy import stats as scipy_stats

from training import paths as paths_lib
from tools.compare import extrapolation as extrapolation_compare

ALPHA = 0.05
LOWER_IS_BETTER = ('final_valid', 'loss.', 'r2', 'r4', 'r8', 'loss_L', 'loss_pos@')


def lower_is_better(metric: str) -> bool:
  return metric.startswith(LOWER_IS_BETTER)


def interval(values):
  """(mean, [lo, hi]) with the 95% t interval across seeds; [None, None] for fewer than two."""
  values = np.asarray(values, np.float64)
  mean = float(np.mean(values))
  if len(values) < 2:
    return mean, [None, None]
  half = scipy_stats.t.ppf(1 - ALPHA / 2, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(
      len(values))
  return mean, [float(mean - half), float(mean + half)]


def _p_value(result, differences):
  """The test's p, or for zero spread 1.0 (no difference at all) or 0.0 (a constant one)."""
  p = float(result.pvalue)
  if math.isnan(p):
    return 1.0 if np.allclose(differences, 0.0) else 0.0
  return p


def test(values, seeds, base_values, base_seeds):
  """(p, 'paired' | 'welch') of cell values against the baseline's, or (None, reason) when a
  side has a single seed. Paired where both cells ran the same seeds."""
  if len(values) < 2 or len(base_values) < 2:
    return None, 'one seed'
  if seeds is not None and base_seeds is not None and sorted(seeds) == sorted(base_seeds) and len(
      set(seeds)) == len(seeds):
    order, base_order = np.argsort(seeds), np.argsort(base_seeds)
    a, b = np.asarray(values)[order], np.asarray(base_values)[base_order]
    differences = a - b
    if np.allclose(differences, differences.mean()):  # no spread: the test is undefined
      return (1.0 if np.allclose(differences, 0.0) else 0.0), 'paired'
    return _p_value(scipy_stats.ttest_rel(a, b), differences), 'paired'
  a, b = np.asarray(values, np.float64), np.asarray(base_values, np.float64)
  spread = np.concatenate([a - a.mean(), b - b.mean()])
  if np.allclose(spread, 0.0):  # no variance on either side: the means are the whole story
    return (1.0 if math.isclose(a.mean(), b.mean()) else 0.0), 'welch'
  return _p_value(scipy_stats.ttest_ind(a, b, equal_var=False), a.mean() - b.mean()), 'welch'


def verdict(metric, mean, base_mean, p):
  """'better' / 'worse' (p < 5%, by the metric's direction), 'n.s.', or 'n/a' (no test)."""
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
  """{cell: {metric: {'mean', 'ci95', 'n', 'p', 'test', 'verdict'}}} of every group (a metric that
  not every seed of a cell has is left out of that cell); 'p', 'test' and 'verdict' against
  `baseline` (a group label), None without one.

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
    per_cell[label] = {name: ([m[name] for m in metrics], [_seed(r) for r in runs])
                       for name in names}
  out = {}
  for label, by_metric in per_cell.items():
    out[label] = {}
    for name, (values, seeds) in by_metric.items():
      mean, ci = interval(values)
      entry = {'mean': mean, 'ci95': ci, 'n': len(values), 'p': None, 'test': None,
               'verdict': None}
      base = per_cell.get(baseline, {}).get(name) if baseline is not None else None
      if base is not None and label != baseline:
        seeds = None if None in seeds else seeds
        base_seeds = None if None in base[1] else base[1]
        p, kind = test(values, seeds, base[0], base_seeds)
        entry.update(p=p, test=kind, verdict=verdict(name, mean, float(np.mean(base[0])), p))
      elif label == baseline:
        entry['verdict'] = 'baseline'
      out[label][name] = entry
  return out


def fmt_interval(entry, digits=4):
  """'mean [lo, hi]' (the 95% interval), or the mean alone for one seed."""
  lo, hi = entry['ci95']
  if lo is None:
    return f'{entry["mean"]:.{digits}f}'
  return f'{entry["mean"]:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]'


def markdown(stats, baseline):
  """| metric | cell | mean [95% CI] | seeds | p | verdict |: a row per metric and cell, metric
  after metric."""
  head = ['metric', 'cell', 'mean [95% CI]', 'seeds', 'p', f'vs {baseline}' if baseline else
          'verdict']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  names = list(dict.fromkeys(name for by_metric in stats.values() for name in by_metric))
  for name in names:
    for label, by_metric in stats.items():
      if name not in by_metric:
        continue
      entry = by_metric[name]
      p = '-' if entry['p'] is None else f'{entry["p"]:.3g} ({entry["test"]})'
      lines.append('| ' + ' | '.join([name, label, fmt_interval(entry), str(entry['n']), p,
                                      entry['verdict'] or '-']) + ' |')
  note = ('Mean and 95% t interval across seeds (Student t with n-1 degrees of freedom). ')
  if baseline:
    note += (f'p: two-sided t-test against {baseline}: paired by seed where both cells ran the '
             "same seeds (train.seed sets the initialisation and the data order), else Welch's; "
             'better/worse at p < 0.05 by the metric\'s direction (loss, final_valid, r_k: lower; '
             'accuracy, retrieval, recall: higher), else n.s. (not separable); n/a: a cell with '
             'one seed.')
  return '\n'.join(lines + ['', note])


def stats_path(out):
  """`<out stem>_stats.json` beside the comparison's picture."""
  return (out[:-4] if out.endswith('.png') else out) + '_stats.json'


def write(stats, out):
  """Writes the stats JSON beside `out`; returns its path."""
  path = stats_path(out)
  paths_lib.makedirs(paths_lib.dirname(paths_lib.absolute(path)))
  paths_lib.write_json(path, stats)
  return path
