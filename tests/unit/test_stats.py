"""tools.compare.stats and tools.compare --baseline: t intervals across seeds (bootstrap ones inside
[0, 1] for bounded metrics), the paired sign-flip or two-sample permutation test, Holm's
correction, the minimum detectable effect, TOST, and verdicts that read n.s. for cells drawn from
one distribution and better/worse for cells ten standard errors apart."""

import json

from tests.helpers import write_run
import numpy as np
import pytest

from tools.compare import comparison as compare
from tools.compare import significance
from tools.compare import stats


def test_the_interval_is_students_t():
  mean, (lo, hi) = stats.interval([1.0, 2.0, 3.0])
  half = 4.302652729911275 * 1.0 / np.sqrt(3)  # t(0.975, 2) x sd / sqrt(n)
  assert mean == 2.0 and np.isclose(lo, 2.0 - half) and np.isclose(hi, 2.0 + half)
  assert stats.interval([5.0]) == (5.0, [None, None])


def test_paired_where_the_seeds_match_unpaired_where_not():
  a, b = [1.0, 2.0, 3.0, 4.0], [1.1, 2.2, 3.1, 4.3]  # the seeds explain most of the spread
  p, kind = stats.test(a, [0, 1, 2, 3], b, [0, 1, 2, 3])
  # Every difference is negative: of the 16 sign patterns only all-minus and all-plus reach as far.
  assert kind == 'paired' and p == 2 / 16
  p, kind = stats.test(a, [0, 1, 2, 3], b, [4, 5, 6, 7])
  assert kind == 'unpaired' and p > 0.5  # unpaired, the same numbers are not separable
  # Pairing follows the seed, not the order the runs were listed in.
  assert stats.test(a, [0, 1, 2, 3], b[::-1], [3, 2, 1, 0]) == (2 / 16, 'paired')
  assert stats.test([1.0], [0], b, [0, 1, 2, 3]) == (None, 'one seed')
  assert stats.test([1.0, 1.0], [0, 1], [1.0, 1.0], [0, 1])[0] == 1.0  # identical: no difference
  # A constant difference at 2 seeds: half the sign patterns reach it, never p = 0.
  assert stats.test([1.0, 1.0], [0, 1], [2.0, 2.0], [0, 1])[0] == 0.5


def test_a_constant_small_difference_at_three_seeds_is_never_better():
  """The old t-test gave p = 0 to a difference with no spread; a sign-flip test at 3 seeds cannot
  go below 2 / 8, so 0.001 nats on every seed reads n.s., with no effect reachable."""
  base = [2.0, 2.1, 2.05]
  lower = [v - 0.001 for v in base]
  p, kind = stats.test(lower, [0, 1, 2], base, [0, 1, 2])
  assert kind == 'paired' and p == 0.25
  assert stats.verdict('final_valid', np.mean(lower), np.mean(base), p) == 'n.s.'
  assert significance.mde(lower, [0, 1, 2], base, [0, 1, 2]) == 'none reachable'
  # Unpaired, 3 against 3: 2 of the C(6, 3) = 20 splits are as extreme as two separated cells.
  assert stats.test([1.0, 1.1, 1.2], None, [2.0, 2.1, 2.2], None) == (0.1, 'unpaired')
  assert significance.smallest_p(3, 3, paired=True) == 0.25
  assert significance.smallest_p(6, 6, paired=True) == 2 / 64


def test_intervals_of_bounded_metrics_stay_in_zero_one():
  values = [1.0, 1.0, 0.42]
  _, (lo, hi) = stats.interval(values)  # an unbounded metric's t interval: [-0.03, 1.64]
  assert lo < 0 and hi > 1
  mean, (lo, hi) = stats.interval(values, 'accuracy.test')
  # At 3 seeds the expanded percentile bootstrap reaches the seeds' range (tail ~1e-7).
  assert np.isclose(mean, 0.80667, atol=1e-5) and (lo, hi) == (0.42, 1.0)
  assert stats.interval(values, 'final_valid')[1] == stats.interval(values)[1]
  rng = np.random.default_rng(1)
  for metric in ('accuracy.test', 'retrieval@256', 'recall_pairs@16', 'recall_distance@8-15'):
    assert stats.bounded(metric)
    for n in (3, 5, 10):
      values = np.clip(1.0 - rng.exponential(0.2, n), 0.0, 1.0)
      _, (lo, hi) = stats.interval(values, metric)
      assert 0.0 <= min(values) <= lo <= np.mean(values) <= hi <= max(values) <= 1.0
  assert not stats.bounded('final_valid') and not stats.bounded('loss.test')
  assert stats.interval([0.5, 1.0], 'accuracy.test') == (0.75, [None, None])  # n/a at 2 seeds
  assert stats.solved('accuracy.test', [1.0, 0.99, 0.989]) == 2 and stats.SOLVED == 0.99
  assert stats.solved('final_valid', [1.0]) is None


def test_holm_adjusts_by_rank():
  # By hand, m = 4: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04,
  # then the running maximum: 0.02, 0.03, 0.06, 0.06.
  adjusted = significance.holm([0.01, 0.04, 0.03, 0.005, None])
  np.testing.assert_allclose(adjusted[:4], [0.03, 0.06, 0.06, 0.02])
  assert adjusted[4] is None
  assert significance.holm([0.5, 0.9]) == [1.0, 1.0]  # capped at 1


def test_the_minimum_detectable_effect():
  # Paired, 6 seeds, differences +-0.1 (sd 0.10954): (t(0.975, 5) + t(0.8, 5)) sd / sqrt(6).
  d = np.array([0.1, -0.1, 0.1, -0.1, 0.1, -0.1])
  base = np.array([2.0, 2.1, 2.2, 2.3, 2.4, 2.5])
  found = significance.mde(base + d, range(6), base, range(6))
  assert np.isclose(found, (2.570582 + 0.919544) * np.std(d, ddof=1) / np.sqrt(6), rtol=1e-5)
  assert np.isclose(found, 0.156082, rtol=1e-5)
  # Unpaired, 4 a side, equal spread s: Welch's df = 6, se = s sqrt(2 / 4).
  a, b = [1.0, 1.1, 1.2, 1.3], [2.0, 2.1, 2.2, 2.3]
  s = np.std(a, ddof=1)
  assert np.isclose(significance.mde(a, None, b, None), (2.446912 + 0.905703) * s * np.sqrt(0.5),
                    rtol=1e-5)
  assert significance.mde([1.0], None, b, None) is None


def test_tost_equivalence():
  base = np.array([2.0, 2.1, 2.2, 2.3, 2.4, 2.5])
  d = np.array([0.001, -0.001, 0.0005, -0.0005, 0.002, 0.0])
  # Every difference lies inside +-0.01: each one-sided sign-flip test has only the observed
  # pattern as extreme, 1 / 2^6.
  assert significance.equivalent(base + d, base, 0.01, range(6), range(6)) == 1 / 64
  # At a margin of 0.001 two differences reach the band's edge and one leaves it: not shown level.
  assert significance.equivalent(base + d, base, 0.001, range(6), range(6)) > 0.05
  # 3 paired seeds can never show equivalence (1 / 8 at best); nor can a gap wider than the margin.
  assert significance.equivalent(base[:3] + d[:3], base[:3], 0.01, range(3), range(3)) == 1 / 8
  assert significance.equivalent(base + 0.05, base, 0.01, range(6), range(6)) == 1.0
  with pytest.raises(ValueError, match='margin must be > 0'):
    significance.equivalent(base, base, 0.0)


def test_verdicts_follow_the_metrics_direction():
  assert stats.verdict('final_valid', 1.0, 2.0, 0.01) == 'better'
  assert stats.verdict('accuracy.test', 1.0, 2.0, 0.01) == 'worse'
  assert stats.verdict('recall_pairs@16', 0.9, 0.5, 0.001) == 'better'
  assert stats.verdict('r4', 1.1, 1.0, 0.001) == 'worse'
  assert stats.verdict('final_valid', 1.0, 2.0, 0.2) == 'n.s.'
  assert stats.verdict('final_valid', 1.0, 2.0, None) == 'n/a'


def _cells(tmp_path, means, noise, seeds=5, rng=None, shared_seeds=True):
  """Sweep cells `name=mean`, `seeds` runs each, final valid loss mean + noise x N(0, 1)."""
  rng = rng or np.random.default_rng(0)
  for name, mean in means.items():
    for s in range(seeds):
      seed = s if shared_seeds else s + 100 * list(means).index(name)
      loss = float(mean + noise * rng.standard_normal())
      write_run(tmp_path / 'sw' / f'model.norm_position={name},seed={seed}',
                [(10, 5.0), (20, loss + 0.1)], [(20, loss)], steps=20, seed=seed,
                fields={'norm_position': name})


def test_same_distribution_reads_ns_and_ten_standard_errors_read_better_or_worse(tmp_path):
  noise, n = 0.05, 5
  se = noise * np.sqrt(2 / n)  # of a difference of two means of n seeds
  _cells(tmp_path, {'base': 2.0, 'same': 2.0, 'lower': 2.0 - 10 * se, 'higher': 2.0 + 10 * se},
         noise, seeds=n, shared_seeds=False)
  out = tmp_path / 'cmp.png'
  table = compare.compare([str(tmp_path / 'sw')], str(out), baseline='norm_position=base')
  written = json.loads((tmp_path / 'cmp_stats.json').read_text())
  about, found = written['about'], written['cells']
  assert about['baseline'] == 'norm_position=base' and len(about['commit'] or 'x' * 40) == 40
  assert about['date'].endswith('+00:00') and about['command']
  verdicts = {cell: found[cell]['final_valid']['verdict'] for cell in found}
  assert verdicts == {'norm_position=base': 'baseline', 'norm_position=same': 'n.s.',
                      'norm_position=lower': 'better', 'norm_position=higher': 'worse'}
  entry = found['norm_position=lower']['final_valid']
  assert entry['n'] == n and entry['ci95'][0] < entry['mean'] < entry['ci95'][1]
  # Unpaired 5 against 5: of the C(10, 5) = 252 splits, only the observed one and its mirror
  # separate the cells as far; Holm over the table's 3 tests triples it.
  assert entry['p'] == 2 / 252 and np.isclose(entry['p_holm'], 3 * 2 / 252)
  same = found['norm_position=same']['final_valid']
  assert same['p'] > 0.05 and same['p_holm'] >= same['p'] and 0 < same['mde'] < 10 * se
  assert '| final_valid | norm_position=same |' in table and ' n.s. (MDE ' in table
  # The main table names the verdict too, under its own header: read back by header.
  lines = table.splitlines()
  first = next(i for i, line in enumerate(lines) if 'final valid vs baseline' in line)
  main = lines[first:lines.index('', first)]  # the table ends at its blank line
  head = [c.strip() for c in main[0].strip('|').split('|')]
  rows = [dict(zip(head, (c.strip() for c in line.strip('|').split('|')))) for line in main[2:]]
  rows = {row['cell']: row for row in rows}
  assert rows['norm_position=base']['final valid vs baseline'] == 'baseline'
  assert rows['norm_position=lower']['final valid vs baseline'] == 'better'
  assert rows['norm_position=higher']['final valid vs baseline'] == 'worse'
  for row in rows.values():
    assert row['best valid'].split()[0] == row['final valid'].split()[0], row  # numbers only
  assert (tmp_path / 'cmp_intervals.png').stat().st_size > 10_000  # the dots with intervals


def test_a_bad_baseline_is_one_line(tmp_path):
  _cells(tmp_path, {'a': 2.0, 'b': 2.1}, 0.01, seeds=2)
  with pytest.raises(ValueError, match=r"--baseline='c' is not a cell of this comparison; "
                     r'valid: norm_position=a, norm_position=b') as e:
    compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'x.png'), baseline='c')
  assert '\n' not in str(e.value)


def test_eval_metrics_join_the_statistics(tmp_path):
  """Five tests for cell b (final_valid, loss, accuracy, two recalls): with 8 paired seeds a gap
  on every seed has p = 2 / 2^8, 5 x that after Holm, still below 5%; at 3 seeds the same gap
  reads n.s. with no effect reachable."""
  for seeds, wanted in ((8, 'worse'), (3, 'n.s.')):
    _cells(tmp_path / str(seeds), {'a': 2.0, 'b': 2.0}, 0.01, seeds=seeds)
    for i, run in enumerate(sorted((tmp_path / str(seeds) / 'sw').iterdir())):
      dense = 'norm_position=a' in run.name
      (run / 'eval.json').write_text(json.dumps({
          'loss': {'test': 1.0}, 'accuracy': {'test': (0.99 if dense else 0.3) + 0.001 * i},
          'recall': {'by_pairs': {'4': 1.0 if dense else 0.5}, 'by_distance': {'2-3': 1.0}}}))
    table = compare.compare([str(tmp_path / str(seeds) / 'sw')], str(tmp_path / 'c.png'),
                            baseline='norm_position=a')
    stats_file = json.loads((tmp_path / 'c_stats.json').read_text())
    found = stats_file['cells']['norm_position=b']
    accuracy = found['accuracy.test']
    assert accuracy['verdict'] == wanted and accuracy['test'] == 'paired'
    assert accuracy['p'] == 2 / 2 ** seeds and np.isclose(accuracy['p_holm'],
                                                   min(1.0, 5 * 2 / 2 ** seeds))
    assert found['recall_pairs@4']['verdict'] == wanted
    assert found['loss.test']['verdict'] == 'n.s.' and found['recall_distance@2-3']['p'] == 1.0
    # k of n seeds solved (>= 0.99), and bounded intervals inside [0, 1].
    assert stats_file['cells']['norm_position=a']['accuracy.test']['solved'] == seeds
    assert accuracy['solved'] == 0 and found['final_valid']['solved'] is None
    assert 0.3 <= accuracy['ci95'][0] <= accuracy['ci95'][1] <= 0.3 + 0.001 * 2 * seeds
    assert f'| {seeds} ({seeds} solved) |' in table and f'| {seeds} (0 solved) |' in table
  assert accuracy['mde'] == 'none reachable'  # 3 seeds
  assert 'n.s. (none reachable at 3 seeds)' in table


def test_the_loss_by_position_joins_the_statistics_in_buckets_four_times_wider(tmp_path):
  """eval.py --lengths=1 keeps the loss at every position of the training length's windows; the
  statistics take its means over positions 0-3, 4-15, 16-63, 64-79 (the window's end)."""
  length = 80
  _cells(tmp_path, {'a': 2.0, 'b': 2.0}, 0.01, seeds=8)  # 6 tests: 8 paired seeds pass Holm
  curve_a = np.linspace(5.0, 3.0, length)
  for run in (tmp_path / 'sw').iterdir():
    seed = int(run.name.rsplit('seed=', 1)[1])
    curve = curve_a + 0.01 * seed
    if 'norm_position=b' in run.name:
      curve[:16] += 0.5 + 0.01 * seed  # b is worse at the first 16 positions only
    (run / 'eval.json').write_text(json.dumps({
        'extrapolation': [{'multiple': 1.0, 'length': length, 'mode': 'non_overlapping',
                           'loss': float(curve.mean())}],
        'extrapolation_per_position': {str(length): curve.tolist()}}))
  compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'c.png'), baseline='norm_position=a')
  found = json.loads((tmp_path / 'c_stats.json').read_text())['cells']
  b = found['norm_position=b']
  assert [m for m in b if m.startswith('loss_pos@')] == [
      'loss_pos@0-3', 'loss_pos@4-15', 'loss_pos@16-63', 'loss_pos@64-79']
  assert b['loss_pos@0-3']['verdict'] == b['loss_pos@4-15']['verdict'] == 'worse'
  assert b['loss_pos@16-63']['verdict'] == b['loss_pos@64-79']['verdict'] == 'n.s.'
  a = found['norm_position=a']['loss_pos@64-79']['mean']
  assert np.isclose(a, curve_a[64:].mean() + 0.035)  # the mean over seeds 0 to 7
