"""A ladder sweep's verdicts (tools.sweep 'ladder'): frontier, fitted law, multiplier, per budget.

A sweep directory holding tools.sweep's `ladder.json` is a ladder: each run is a variant at one
size and one training-FLOP budget. A CELL here is a variant, named by its overrides without the
size and the budget (`model.attention=mla`; `base` for the sweep file's own config), the name
--baseline takes. The frontier, the fit and the multiplier are tools/compare/ladder_fit.py's.

Verdicts: at each budget the variant's frontier seeds against the baseline's (the permutation test
of tools/compare/significance.py, paired by seed where both ran the same seeds), Holm's correction
over every (variant, budget) test of the ladder, `better` / `worse` at 5% of the corrected p, else
`n.s.`. Overall: `better` (or `worse`) only when every budget reads it; `budget-dependent` when
budgets read significantly in opposite directions; `n.s.` otherwise. The numbers go to
`<out stem>_ladder.json`, the picture to `<out stem>_ladder.png` (tools/compare/ladder_figure.py).
"""

import json
import math

import numpy as np

from training import paths as paths_lib
from tools.compare import ladder_figure
from tools.compare import ladder_fit
from tools.compare import significance
from tools.compare import stats as stats_lib

INDEX = 'ladder.json'  # tools.sweep.ladder.INDEX (tools.compare reads it, never imports the sweep)
BASE = 'base'  # the variant that overrides nothing


def read_index(paths):
  """{cell name without seed: {'variant', 'size', 'flops'}} of every ladder sweep dir in `paths`."""
  out = {}
  for path in paths:
    index = paths_lib.join(path, INDEX)
    if paths_lib.exists(index):
      out.update(json.loads(paths_lib.read_text(index)))
  return out


def collect(runs, index):
  """{variant: {(size, budget): {'compute', 'losses': {seed: final valid loss}}}} of the runs the
  index names that have a finite final validation loss; 'compute' is the mean of their
  run_info.json train_flops (the budget where none recorded it)."""
  out, spent = {}, {}
  for run in runs:
    entry = index.get(paths_lib.basename(run['workdir']).rsplit(',seed=', 1)[0])
    _, valid = run['valid']
    if entry is None or not len(valid) or not math.isfinite(valid[-1]):
      continue
    key = (entry['size'], float(entry['flops']))
    cell = out.setdefault(entry['variant'] or BASE, {}).setdefault(
        key, {'compute': key[1], 'losses': {}})
    seed = (run.get('config') or {}).get('train.seed', len(cell['losses']))
    cell['losses'][int(seed)] = float(valid[-1])
    spent.setdefault((entry['variant'] or BASE, key), []).append(
        (run.get('info') or {}).get('train_flops') or key[1])
  for (variant, key), values in spent.items():
    out[variant][key]['compute'] = float(np.mean(values))
  return out


def analyse(cells, baseline):
  """The `<out>_ladder.json` dict of `collect`'s cells (module docstring).

  Raises:
    ValueError: `baseline` is not a variant of the ladder (one line, with the valid names).
  """
  if baseline not in cells:
    raise ValueError(f'--baseline={baseline!r} is not a variant of this ladder; valid: '
                     f'{", ".join(sorted(cells))}')
  names = list(cells)
  fronts = [ladder_fit.frontier(cells[v]) for v in names]
  budgets = sorted({b for f in fronts for b, _, _ in f})
  scale = math.exp(np.mean(np.log(budgets)))
  mode = ladder_fit.e_mode(fronts)
  laws = dict(zip(names, ladder_fit.fit_laws(fronts, scale, mode)))
  out = {'baseline': baseline, 'budgets': budgets, 'e': mode, 'cells': {}}
  base_front = dict(zip(names, fronts))[baseline]
  for name, front in zip(names, fronts):
    ratios = ladder_fit.per_budget_multipliers(front, laws[baseline])
    lo, hi = (ladder_fit.multiplier_interval(cells[name], cells[baseline], laws[baseline], mode,
                                             scale) if name != baseline else (1.0, 1.0))
    e, a, alpha = laws[name]
    out['cells'][name] = {
        'fit': {'E': e, 'A': a, 'alpha': alpha},
        # The baseline against itself is 1 by definition, not its fit's residual.
        'multiplier': {'value': ladder_fit.geometric_mean(ratios) if name != baseline else 1.0,
                       'lo': lo, 'hi': hi},
        'by_budget': _by_budget(front, base_front if name != baseline else None),
    }
  _verdicts(out)
  return out


def _by_budget(front, base_front):
  """{budget text: {'loss': {'mean', 'ci95'}, 'size', 'compute', 'p'}} of a frontier, each tested
  against the baseline's point at the same budget."""
  base = {b: losses for b, _, losses in base_front or []}
  out = {}
  for budget, compute, losses in front:
    seeds = sorted(losses)
    mean, ci = stats_lib.interval([losses[s] for s in seeds])
    entry = {'loss': {'mean': mean, 'ci95': ci}, 'compute': compute, 'p': None}
    if budget in base:
      base_seeds = sorted(base[budget])
      entry['p'], _ = significance.test([losses[s] for s in seeds], seeds,
                                        [base[budget][s] for s in base_seeds], base_seeds)
      entry['base_mean'] = float(np.mean(list(base[budget].values())))
    out[f'{budget:g}'] = entry
  return out


def _verdicts(out):
  """Holm over every (variant, budget) test of the ladder, then each budget's and each variant's
  verdict."""
  tested = [(c, b) for c, cell in out['cells'].items() for b, e in cell['by_budget'].items()
            if e['p'] is not None]
  adjusted = significance.holm([out['cells'][c]['by_budget'][b]['p'] for c, b in tested])
  for (c, b), p in zip(tested, adjusted):
    entry = out['cells'][c]['by_budget'][b]
    entry['p_holm'] = p
    entry['verdict'] = stats_lib.verdict('final_valid', entry['loss']['mean'], entry['base_mean'],
                                         p)
  for name, cell in out['cells'].items():
    if name == out['baseline']:
      cell['verdict'] = 'baseline'
      for entry in cell['by_budget'].values():
        entry['verdict'] = 'baseline'
      continue
    cell['verdict'] = overall([e.get('verdict', 'n/a') for e in cell['by_budget'].values()])


def overall(verdicts):
  """'better' / 'worse' when every budget reads it, 'budget-dependent' when budgets read both,
  else 'n.s.'."""
  kinds = set(verdicts)
  if kinds == {'better'} or kinds == {'worse'}:
    return verdicts[0]
  if {'better', 'worse'} <= kinds:
    return 'budget-dependent'
  return 'n.s.'


def ladder_path(out, suffix='.json'):
  return (out[:-4] if out.endswith('.png') else out) + '_ladder' + suffix


def markdown(result):
  """The ladder table: per variant the fit, the multiplier and each budget's loss and verdict."""
  budgets = [f'{b:g}' for b in result['budgets']]
  lines = ['| variant | E | A | alpha | multiplier [95%] | ' + ' | '.join(
      f'loss @ {b}' for b in budgets) + ' | verdict |',
           '|---|---:|---:|---:|---:|' + '---:|' * len(budgets) + '---|']
  for name, cell in result['cells'].items():
    fit, m = cell['fit'], cell['multiplier']
    mult = 'n/a' if m['value'] is None else (
        f'{m["value"]:.3g} [{_g(m["lo"])}, {_g(m["hi"])}]')
    losses = []
    for b in budgets:
      e = cell['by_budget'].get(b)
      losses.append('' if e is None else f'{e["loss"]["mean"]:.4f} {e.get("verdict", "")}')
    lines.append(f'| {name} | {fit["E"]:.3f} | {fit["A"]:.3g} | {fit["alpha"]:.3f} | {mult} | '
                 + ' | '.join(losses) + f' | {cell["verdict"]} |')
  note = (f'Ladder against {result["baseline"]}: frontier = best size per budget (mean final '
          f'validation loss); L(C) = E + A·C^-alpha (E {result["e"]}); multiplier = compute the '
          'baseline law needs for the variant\'s loss / compute spent, geometric mean over '
          'budgets, bootstrap 95% over seeds and budgets; verdicts: permutation tests, Holm over '
          'the ladder, 5%.')
  return '\n'.join(lines + ['', note])


def _g(value):
  return 'n/a' if value is None else f'{value:.3g}'


def report(runs, paths, out, baseline):
  """The ladder's markdown, `<out stem>_ladder.json` and `_ladder.png` when `paths` hold a ladder
  sweep ('' otherwise, or without a --baseline: a ladder's verdicts are against one)."""
  index = read_index(paths)
  if not index:
    return ''
  cells = collect(runs, index)
  if baseline is None:
    return (f'Ladder sweep: name a variant with --baseline (one of {", ".join(sorted(cells))}) '
            'for its fits, multipliers and verdicts.')
  result = analyse(cells, baseline)
  path = ladder_path(out)
  paths_lib.write_text(path, json.dumps(result, indent=2))
  drawn = ladder_figure.draw(result, cells, ladder_path(out, '.png'))
  return f'Ladder (numbers in {path}; picture: {drawn}):\n\n' + markdown(result)
