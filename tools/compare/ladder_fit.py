"""Compute-optimal frontiers, L(C) = E + A·C^(-alpha) fits and effective-compute multipliers.

The frontier of a variant: at each training-FLOP budget, its size with the lowest mean final
validation loss over seeds. The law is fitted to the frontier means by least squares on log loss
(`scipy.optimize.least_squares`, log residuals so that every budget weighs alike however far the
losses fall), with C in units of the budgets' geometric mean so A stays near the losses' scale.

E, the irreducible loss, is a property of the data more than of the variant, and three noisy
points cannot pin three parameters: it is fitted per variant only when every variant has at least
MIN_OWN_E frontier points; otherwise one E is shared by all variants in a joint fit (each keeping
its own A and alpha), and pinned at 0 (a plain power law) when even the joint fit has no more
points than parameters.

The effective-compute multiplier of a variant against a baseline: at each budget, the compute the
baseline's fitted law needs to reach the variant's frontier loss, divided by the compute the
variant spent there (run_info.json's train_flops, else the budget); the geometric mean over
budgets (budgets where the variant's loss is at or below the baseline's E, which the baseline
never reaches, are left out). Its 95% interval is a percentile bootstrap over seeds (each
(size, budget) cell's seeds redrawn with replacement, frontiers and the baseline's law redone) and
over ladder points (the budgets redrawn for the geometric mean), BOOTSTRAP draws from a fixed seed:
deterministic.
"""

import math

import numpy as np
from scipy import optimize

MIN_OWN_E = 4  # frontier points each variant needs for an E of its own
BOOTSTRAP = 400  # draws of the multiplier's interval
SEED = 0  # of the bootstrap: the interval is the same on every call


def frontier(cells):
  """[(budget, compute, losses by seed {seed: loss})] of one variant, budgets ascending: at each
  budget the size with the lowest mean loss.

  Args:
    cells: {(size, budget): {'compute': FLOPs spent, 'losses': {seed: final valid loss}}}.
  """
  best = {}
  for (_, budget), cell in cells.items():
    mean = float(np.mean(list(cell['losses'].values())))
    if budget not in best or mean < best[budget][0]:
      best[budget] = (mean, cell)
  return [(b, best[b][1]['compute'], best[b][1]['losses']) for b in sorted(best)]


def _residuals(params, xs, ys, owners, e_mode):
  """Log residuals of the joint fit: params = [E (unless pinned)] + [log A, alpha] per variant."""
  e = 0.0 if e_mode == 'pinned' else params[0]
  pairs = np.reshape(params[0 if e_mode == 'pinned' else 1:], (-1, 2))[owners]  # [points, 2]
  return np.log(ys) - np.log(e + np.exp(pairs[:, 0]) * xs ** -pairs[:, 1])


def _fit_group(points, scale, e_mode, law=None):
  """Least squares of `points` [[(compute, mean loss)] per variant] with one E over all of them
  (e_mode 'shared'), or E = 0 ('pinned'), started from `law` (E, A, alpha) of a single variant
  when given (the bootstrap's refits start from the point estimate). Returns [(E, A, alpha)] per
  variant."""
  xs = np.array([c / scale for pts in points for c, _ in pts])
  ys = np.array([y for pts in points for _, y in pts])
  owners = np.array([v for v, pts in enumerate(points) for _ in pts])
  low = min(ys)
  start, lo, hi = [], [], []
  if e_mode != 'pinned':
    start, lo, hi = [0.5 * low], [0.0], [low * (1 - 1e-9)]  # E below every loss: log stays real
  for pts in points:
    start += [math.log(max(np.mean([y for _, y in pts]) - (start[0] if start else 0), 1e-6)),
              0.3]
    lo += [-50.0, 0.0]
    hi += [50.0, 5.0]
  if law is not None and len(points) == 1 and e_mode == 'shared':
    e, a, alpha = law
    start = [e, math.log(a / scale ** alpha), alpha]
  # least_squares needs a start strictly inside the bounds (an alpha fitted at 0, an E above
  # a redrawn frontier's lowest loss).
  span = np.subtract(hi, lo) * 1e-6
  start = np.clip(start, np.add(lo, span), np.subtract(hi, span))
  fit = optimize.least_squares(_residuals, start, bounds=(lo, hi),
                               args=(xs, ys, owners, e_mode))
  e = 0.0 if e_mode == 'pinned' else float(fit.x[0])
  off = 0 if e_mode == 'pinned' else 1
  return [(e, float(math.exp(fit.x[off + 2 * v]) * scale ** fit.x[off + 2 * v + 1]),
           float(fit.x[off + 2 * v + 1])) for v in range(len(points))]


def e_mode(fronts):
  """'own' (every variant has MIN_OWN_E points or more), 'shared', or 'pinned' (the joint fit
  would have no more points than parameters)."""
  counts = [len(f) for f in fronts]
  if min(counts) >= MIN_OWN_E:
    return 'own'
  return 'shared' if sum(counts) > 1 + 2 * len(counts) else 'pinned'


def fit_laws(fronts, scale, mode):
  """[(E, A, alpha)] per frontier (C in FLOPs: L = E + A·C^-alpha), E handled by `mode`."""
  points = [[(c, float(np.mean(list(losses.values())))) for _, c, losses in f] for f in fronts]
  if mode == 'own':
    return [_fit_group([pts], scale, 'shared')[0] for pts in points]
  return _fit_group(points, scale, mode)


def compute_to_reach(law, loss):
  """The compute at which `law` (E, A, alpha) reaches `loss`; None where it never does."""
  e, a, alpha = law
  if loss <= e or alpha <= 0:
    return None
  return (a / (loss - e)) ** (1 / alpha)


def per_budget_multipliers(front, base_law):
  """[compute the baseline law needs for the variant's mean loss / compute the variant spent] of
  each frontier point (None where the law never reaches it)."""
  out = []
  for _, compute, losses in front:
    needed = compute_to_reach(base_law, float(np.mean(list(losses.values()))))
    out.append(None if needed is None else needed / compute)
  return out


def geometric_mean(values):
  kept = [v for v in values if v is not None and v > 0]
  return float(math.exp(np.mean(np.log(kept)))) if kept else None


def multiplier_interval(cells, base_cells, base_law, mode, scale):
  """(lo, hi) of the 95% percentile bootstrap of the multiplier (the module docstring)."""
  rng = np.random.default_rng(SEED)
  draws = []
  for _ in range(BOOTSTRAP):
    front = frontier(_redraw(cells, rng))
    base_front = frontier(_redraw(base_cells, rng))
    law = base_law
    if mode == 'own':
      points = [(c, float(np.mean(list(losses.values())))) for _, c, losses in base_front]
      law = _fit_group([points], scale, 'shared', base_law)[0]
    elif mode == 'shared':  # E stays the joint fit's: A and alpha refitted around it
      law = _refit_fixed_e(base_front, base_law[0], scale)
    ratios = per_budget_multipliers(front, law)
    picks = rng.integers(0, len(ratios), len(ratios))  # the ladder points, redrawn
    value = geometric_mean([ratios[i] for i in picks])
    if value is not None:
      draws.append(value)
  if not draws:
    return None, None
  return float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def _refit_fixed_e(front, e, scale):
  """(E, A, alpha) of one frontier with E held at `e`."""
  xs = np.array([c / scale for _, c, _ in front])
  ys = np.array([float(np.mean(list(losses.values()))) for _, _, losses in front])
  fit = optimize.least_squares(
      lambda p: np.log(ys) - np.log(e + np.exp(p[0]) * xs ** -p[1]),
      [math.log(max(float(np.mean(ys)) - e, 1e-6)), 0.3], bounds=([-50, 0], [50, 5]))
  return e, float(math.exp(fit.x[0]) * scale ** fit.x[1]), float(fit.x[1])


def _redraw(cells, rng):
  """`cells` with each cell's seeds drawn with replacement (keys renumbered)."""
  out = {}
  for key, cell in cells.items():
    values = list(cell['losses'].values())
    picked = rng.choice(values, len(values), replace=True)
    out[key] = {'compute': cell['compute'], 'losses': dict(enumerate(picked.tolist()))}
  return out
