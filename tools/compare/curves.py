"""Loss curves across seeds: smoothing (--smooth) and a group's mean with a band (--band)."""

import numpy as np

BANDS = ('minmax', 'std', 'none')  # --band: the spread drawn around a group's mean across seeds
SMOOTHINGS = ('ema', 'ma')


def smooth(losses, spec):
  """'ema:0.9' (debiased exponential moving average, as TensorBoard's slider), a bare float in
  (0, 1) (EMA), 'ma:K' (trailing moving average of K points), or None/'none'/'0'."""
  if spec in (None, '', 'none', '0'):
    return losses
  kind, number = _parse_smoothing(spec)
  x = np.asarray(losses, np.float64)
  if kind == 'ema':
    return _exponential_moving_average(x, number)
  return _moving_average(x, number)


def _parse_smoothing(spec):
  """('ema', beta) or ('ma', window) of a --smooth value; ValueError naming the valid forms."""
  kind, _, value = spec.partition(':')
  if not value:
    kind, value = 'ema', kind
  try:
    number = float(value) if kind == 'ema' else int(value)
  except ValueError:
    raise ValueError(f'--smooth={spec!r} is not valid; valid: ema:B (0 <= B < 1, or a bare B), '
                     'ma:K (an integer K >= 1), none') from None
  if kind not in SMOOTHINGS:
    raise ValueError(f'--smooth={spec!r}: valid forms: ema:BETA, BETA, ma:K, none')
  if kind == 'ema' and not 0.0 <= number < 1.0:
    raise ValueError(f'--smooth: the EMA coefficient {number} must be in [0, 1)')
  if kind == 'ma' and number < 1:
    raise ValueError(f'--smooth: the moving-average window {number} must be >= 1')
  return kind, number


def _exponential_moving_average(x, beta):
  """The EMA of x, divided by the weight it has gathered so far: the first points are not pulled
  towards the average's zero start."""
  out = np.empty_like(x)
  acc = weight = 0.0
  for i, value in enumerate(x):
    acc = beta * acc + (1 - beta) * value
    weight = beta * weight + (1 - beta)
    out[i] = acc / weight
  return out


def _moving_average(x, k):
  """The mean of each point and the k - 1 before it (fewer at the start)."""
  cumulative = np.concatenate([[0.0], np.cumsum(x)])
  idx = np.arange(len(x))
  lo = np.maximum(0, idx - k + 1)
  return (cumulative[idx + 1] - cumulative[lo]) / (idx + 1 - lo)


def band(curves, kind='minmax'):
  """Mean and spread across runs of (steps, losses) curves, on the union of their steps.

  A run missing a step (shorter, or stopped) or with a non-finite loss there does not count at that
  step.

  Args:
    curves: [(steps, losses)], one per run.
    kind: the spread: 'minmax' (lowest and highest run), 'std' (mean -/+ one standard deviation
      across runs) or 'none' (lo = hi = mean).

  Returns:
    (steps, mean, lo, hi) arrays.
  """
  if kind not in BANDS:
    raise ValueError(f'--band={kind!r}: valid values: {", ".join(BANDS)}')
  if curves:
    steps = np.unique(np.concatenate([s for s, _ in curves]))
  else:
    steps = np.array([], np.int64)
  grid = np.full((len(curves), len(steps)), np.nan)  # [runs, steps]
  for i, (s, losses) in enumerate(curves):
    grid[i, np.searchsorted(steps, s)] = np.where(np.isfinite(losses), losses, np.nan)
  logged = ~np.all(np.isnan(grid), 0)  # steps at which some run has a finite loss
  grid, steps = grid[:, logged], steps[logged]
  mean = np.nanmean(grid, 0)
  if kind == 'minmax':
    return steps, mean, np.nanmin(grid, 0), np.nanmax(grid, 0)
  if kind == 'std':
    std = np.nanstd(grid, 0)
    return steps, mean, mean - std, mean + std
  return steps, mean, mean, mean
