"""Tests across seeds for tools.compare.stats: permutation tests, Holm's correction, the minimum
detectable effect and an equivalence test (TOST).

Both tests are permutation tests of the difference in means, so that no p value rests on a
normality that three to ten seeds cannot show, and none is 0:
- paired (both cells ran the same seeds): the sign-flip test on the per-seed differences. Under the
  null the sign of each difference is a coin flip; p is the share of the 2^n sign patterns whose
  mean difference is at least as far from 0 as the observed one. Its smallest two-sided p is
  2 / 2^n: 0.25 at 3 seeds, 0.0625 at 5, 0.031 at 6, so a paired comparison needs 6 seeds or
  more to read `better` or `worse` at 5% before any correction.
- unpaired: the two-sample permutation test. Under the null the seeds of both cells are
  exchangeable; p is the share of the C(n + m, n) splits of the pooled values into groups of n
  and m whose difference in means is at least as far from 0. Smallest p: 2 / C(2n, n) for n
  seeds a side (0.1 at 3, 0.029 at 4, 0.0079 at 5).
Both enumerate every arrangement while there are at most EXACT_LIMIT (2^16: up to 16 paired seeds,
9 + 9 unpaired ones) and beyond draw DRAWS random arrangements from a fixed seed, with p =
(hits + 1) / (DRAWS + 1) (the observed arrangement counted, so p > 0); results are deterministic.
"""

import functools
import itertools
import math

import numpy as np
from scipy import stats as scipy_stats

ALPHA = 0.05  # two-sided level of every test
POWER = 0.8  # of the minimum detectable effect
EXACT_LIMIT = 2 ** 16  # arrangements enumerated exactly; beyond, DRAWS random ones
DRAWS = 20_000
SEED = 0  # of the random arrangements: the same data give the same p
# Floating-point slack when comparing an arrangement's statistic with the observed one: the same
# mean summed in another order differs in its last bits, and must count as a tie.
TIE = 1e-9
NONE_REACHABLE = 'none reachable'


def pair(values, seeds, base_values, base_seeds):
  """(a, b, paired): the two cells' values as float arrays, in seed order where the cells ran the
  same distinct seeds (then paired is True: seed s of one and seed s of the other share the
  initialisation and the data order)."""
  if (seeds is not None and base_seeds is not None and sorted(seeds) == sorted(base_seeds)
      and len(set(seeds)) == len(seeds)):
    a = np.asarray(values, np.float64)[np.argsort(seeds)]
    return a, np.asarray(base_values, np.float64)[np.argsort(base_seeds)], True
  return np.asarray(values, np.float64), np.asarray(base_values, np.float64), False


@functools.lru_cache(maxsize=None)
def _all_signs(n):
  """[2^n, n] every sign pattern; row i flips the seeds whose bit is set in i (row 0: observed).
  Cached: a table tests every metric of every cell at the same seed count."""
  return 1 - 2 * ((np.arange(2 ** n)[:, None] >> np.arange(n)) & 1)


@functools.lru_cache(maxsize=None)
def _all_splits(total, n):
  """[C(total, n), n] the indices of every group of n among `total` (row 0: the first n)."""
  return np.array(list(itertools.combinations(range(total), n)))


def _null(a, b, paired):
  """(statistic under each arrangement, the observed statistic, exact): the mean difference
  under every arrangement (exact) or under DRAWS random ones."""
  rng = np.random.default_rng(SEED)
  if paired:
    d = a - b
    exact = 2 ** len(d) <= EXACT_LIMIT
    signs = _all_signs(len(d)) if exact else rng.choice([-1.0, 1.0], (DRAWS, len(d)))
    return signs @ d / len(d), float(d.mean()), exact
  pooled = np.concatenate([a, b])
  exact = math.comb(len(pooled), len(a)) <= EXACT_LIMIT
  if exact:
    index = _all_splits(len(pooled), len(a))
  else:
    index = rng.permuted(np.tile(np.arange(len(pooled)), (DRAWS, 1)), axis=1)[:, :len(a)]
  sums = pooled[index].sum(1)
  return sums / len(a) - (pooled.sum() - sums) / len(b), float(a.mean() - b.mean()), exact


def permutation_p(a, b, paired, alternative='two-sided'):
  """p of the permutation test of mean(a) - mean(b) (sign-flip where `paired`).

  Args:
    a: the cell's values (in seed order where paired).
    b: the baseline's values (likewise).
    paired: the sign-flip test on a - b; else the two-sample permutation test.
    alternative: 'two-sided', 'greater' (mean(a) > mean(b)) or 'less'.

  Returns:
    p in (0, 1].
  """
  null, observed, exact = _null(a, b, paired)
  tie = TIE * float(np.max(np.abs(np.concatenate([a, b]))))
  hits = {'two-sided': lambda: np.abs(null) >= abs(observed) - tie,
          'greater': lambda: null >= observed - tie,
          'less': lambda: null <= observed + tie}[alternative]()
  if exact:
    return float(hits.sum() / len(null))
  return float((hits.sum() + 1) / (len(null) + 1))


def smallest_p(n, m, paired):
  """The smallest two-sided p the test can give with n and m seeds, whatever the values (paired:
  the cells' common n; unpaired with n != m the two extreme splits may differ, so 1 / count)."""
  count = 2 ** n if paired else math.comb(n + m, n)
  if count > EXACT_LIMIT:
    return 1 / (DRAWS + 1)
  return (2 if paired or n == m else 1) / count


def test(values, seeds, base_values, base_seeds):
  """(p, 'paired' | 'unpaired') of a cell's values against the baseline's (the two-sided sign-flip
  or two-sample permutation test), or (None, 'one seed') when a side has a single seed."""
  if len(values) < 2 or len(base_values) < 2:
    return None, 'one seed'
  a, b, paired = pair(values, seeds, base_values, base_seeds)
  return permutation_p(a, b, paired), 'paired' if paired else 'unpaired'


def mde(values, seeds, base_values, base_seeds):
  """The approximate t-based minimum detectable effect of `test`: the difference in means it finds
  with 80% power at two-sided 5% (uncorrected), given the observed spread and seeds.

  Paired: (t_{1-a/2, n-1} + t_{0.8, n-1}) sd(a - b) / sqrt(n); unpaired the same with Welch's
  standard error and degrees of freedom. Approximate: it is the t-test's, and at a few seeds a
  permutation test has less power than that, so the true one is larger; a table corrected by
  Holm needs larger effects again.

  Returns:
    The effect in the metric's units; NONE_REACHABLE where even the largest effect cannot reach
    5% at these seed counts (`smallest_p` > ALPHA); None where a side has one seed.
  """
  if len(values) < 2 or len(base_values) < 2:
    return None
  a, b, paired = pair(values, seeds, base_values, base_seeds)
  if smallest_p(len(a), len(b), paired) > ALPHA:
    return NONE_REACHABLE
  if paired:
    se, df = np.std(a - b, ddof=1) / math.sqrt(len(a)), len(a) - 1
  else:
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    se = math.sqrt(va + vb)
    # Welch-Satterthwaite; with no spread on either side se is 0 and df does not matter.
    df = ((va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0
          else len(a) + len(b) - 2)
  return float((scipy_stats.t.ppf(1 - ALPHA / 2, df) + scipy_stats.t.ppf(POWER, df)) * se)


def holm(ps):
  """Holm's step-down adjusted p values, in the order of `ps` (None entries stay None).

  The i-th smallest of m p values becomes max over j <= i of min(1, (m - j + 1) p_(j)): a verdict
  at adjusted p < 5% keeps the chance of any false `better`/`worse` in the family below 5%.
  """
  order = sorted((p, i) for i, p in enumerate(ps) if p is not None)
  out = [None] * len(ps)
  running = 0.0
  for rank, (p, i) in enumerate(order):
    running = max(running, min(1.0, (len(order) - rank) * p))
    out[i] = running
  return out


def equivalent(values, base, margin, seeds=None, base_seeds=None):
  """p of the two one-sided tests (TOST) that |mean(values) - mean(base)| < margin.

  Each one-sided test is the permutation test of `test` (paired where both seed lists name the
  same seeds) on values shifted by the margin: H0 difference <= -margin against > -margin, and
  H0 difference >= margin against < margin; the TOST p is the larger. Only p < 5% lets a page call
  two cells level at this margin (an `n.s.` alone never does); a one-sided sign-flip test at n
  seeds gives at least 1 / 2^n, so 5 paired seeds are the fewest that can.

  Args:
    values: the cell's values, one per seed.
    base: the baseline's.
    margin: the largest difference (> 0, in the metric's units) that counts as level.
    seeds: the seeds of `values`, for pairing (None: unpaired).
    base_seeds: those of `base`.

  Returns:
    The TOST p, or None where a side has one seed.

  Raises:
    ValueError: margin is not positive.
  """
  if not margin > 0:
    raise ValueError(f'equivalence margin must be > 0, got {margin}')
  if len(values) < 2 or len(base) < 2:
    return None
  a, b, paired = pair(values, seeds, base, base_seeds)
  above = permutation_p(a + margin, b, paired, 'greater')  # H0: difference <= -margin
  below = permutation_p(a - margin, b, paired, 'less')  # H0: difference >= margin
  return max(above, below)
