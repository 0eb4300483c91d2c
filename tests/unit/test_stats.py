"""tools.compare.stats and tools.compare --baseline: t intervals across seeds, the paired or Welch
test, and verdicts that read n.s. for cells drawn from one distribution and better/worse for cells
ten standard errors apart."""

import json

from tests.helpers import write_run
import numpy as np
import pytest
from scipy import stats as scipy_stats

from tools.compare import comparison as compare
from tools.compare import stats


def test_the_interval_is_students_t():
  mean, (lo, hi) = stats.interval([1.0, 2.0, 3.0])
  half = 4.302652729911275 * 1.0 / np.sqrt(3)  # t(0.975, 2) x sd / sqrt(n)
  assert mean == 2.0 and np.isclose(lo, 2.0 - half) and np.isclose(hi, 2.0 + half)
  assert stats.interval([5.0]) == (5.0, [None, None])


def test_paired_where_the_seeds_match_welch_where_not():
  a, b = [1.0, 2.0, 3.0, 4.0], [1.1, 2.2, 3.1, 4.3]  # the seeds explain most of the spread
  p, kind = stats.test(a, [0, 1, 2, 3], b, [0, 1, 2, 3])
  assert kind == 'paired' and np.isclose(p, scipy_stats.ttest_rel(a, b).pvalue) and p < 0.05
  p, kind = stats.test(a, [0, 1, 2, 3], b, [4, 5, 6, 7])
  assert kind == 'welch' and np.isclose(p, scipy_stats.ttest_ind(a, b, equal_var=False).pvalue)
  assert p > 0.5  # unpaired, the same numbers are not separable
  # Pairing follows the seed, not the order the runs were listed in.
  assert stats.test(a, [0, 1, 2, 3], b[::-1], [3, 2, 1, 0])[1] == 'paired'
  assert stats.test([1.0], [0], b, [0, 1, 2, 3]) == (None, 'one seed')
  assert stats.test([1.0, 1.0], [0, 1], [1.0, 1.0], [0, 1])[0] == 1.0  # identical: no difference
  assert stats.test([1.0, 1.0], [0, 1], [2.0, 2.0], [0, 1])[0] == 0.0  # a constant difference


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
  found = json.loads((tmp_path / 'cmp_stats.json').read_text())
  verdicts = {cell: found[cell]['final_valid']['verdict'] for cell in found}
  assert verdicts == {'norm_position=base': 'baseline', 'norm_position=same': 'n.s.',
                      'norm_position=lower': 'better', 'norm_position=higher': 'worse'}
  entry = found['norm_position=lower']['final_valid']
  assert entry['n'] == n and entry['ci95'][0] < entry['mean'] < entry['ci95'][1]
  assert entry['p'] < 1e-4 and found['norm_position=same']['final_valid']['p'] > 0.05
  assert '| final_valid | norm_position=same |' in table and ' n.s. ' in table
  assert 'final valid vs baseline' in table  # the main table names the verdict too
  assert (tmp_path / 'cmp_intervals.png').stat().st_size > 10_000  # the dots with intervals


def test_a_bad_baseline_is_one_line(tmp_path):
  _cells(tmp_path, {'a': 2.0, 'b': 2.1}, 0.01, seeds=2)
  with pytest.raises(ValueError, match=r"--baseline='c' is not a cell of this comparison; "
                     r'valid: norm_position=a, norm_position=b') as e:
    compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'x.png'), baseline='c')
  assert '\n' not in str(e.value)


def test_eval_metrics_join_the_statistics(tmp_path):
  _cells(tmp_path, {'a': 2.0, 'b': 2.0}, 0.01, seeds=3)
  for i, run in enumerate(sorted((tmp_path / 'sw').iterdir())):
    dense = 'norm_position=a' in run.name
    (run / 'eval.json').write_text(json.dumps({
        'loss': {'test': 1.0}, 'accuracy': {'test': (0.99 if dense else 0.3) + 0.001 * i},
        'recall': {'by_pairs': {'4': 1.0 if dense else 0.5}, 'by_distance': {'2-3': 1.0}}}))
  compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'c.png'), baseline='norm_position=a')
  found = json.loads((tmp_path / 'c_stats.json').read_text())['norm_position=b']
  assert found['accuracy.test']['verdict'] == 'worse' and found['accuracy.test']['test'] == 'paired'
  assert found['recall_pairs@4']['verdict'] == 'worse'
  assert found['loss.test']['verdict'] == 'n.s.' and found['recall_distance@2-3']['p'] == 1.0


def test_the_loss_by_position_joins_the_statistics_in_buckets_four_times_wider(tmp_path):
  """eval.py --lengths=1 keeps the loss at every position of the training length's windows; the
  statistics take its means over positions 0-3, 4-15, 16-63, 64-79 (the window's end)."""
  length = 80
  _cells(tmp_path, {'a': 2.0, 'b': 2.0}, 0.01, seeds=3)
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
  found = json.loads((tmp_path / 'c_stats.json').read_text())
  b = found['norm_position=b']
  assert [m for m in b if m.startswith('loss_pos@')] == [
      'loss_pos@0-3', 'loss_pos@4-15', 'loss_pos@16-63', 'loss_pos@64-79']
  assert b['loss_pos@0-3']['verdict'] == b['loss_pos@4-15']['verdict'] == 'worse'
  assert b['loss_pos@16-63']['verdict'] == b['loss_pos@64-79']['verdict'] == 'n.s.'
  a = found['norm_position=a']['loss_pos@64-79']['mean']
  assert np.isclose(a, curve_a[64:].mean() + 0.01)  # the mean over seeds 0, 1, 2
