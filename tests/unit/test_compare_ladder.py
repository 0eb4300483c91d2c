"""Ladder comparisons (tools/compare/ladder.py, ladder_fit.py): the fitted law, the
effective-compute multiplier and the verdicts on synthetic losses drawn from a known law."""

import json
import os

import numpy as np
import pytest

from tests.helpers import write_run
from tools.compare import comparison as compare
from tools.compare import ladder as ladder_lib

E, A, ALPHA = 1.5, 4000.0, 0.3  # L(C) = E + A·C^-alpha, C in FLOPs: 1.0 above E at 1e12
BUDGETS = [1e12, 1e13, 1e14, 1e15, 1e16]
SIZES = {'small': 0.08, 'medium': 0.0, 'large': 0.04}  # above the law: medium is the frontier


def law(c, multiplier=1.0):
  return E + A * (multiplier * c) ** -ALPHA


def cells_of(multiplier=1.0, shift=0.0, seeds=4, sizes=SIZES, noise=0.002, rng_seed=1):
  """collect()'s cells for a variant whose frontier is `law(C, multiplier) + shift`."""
  rng = np.random.default_rng(rng_seed)
  out = {}
  for size, penalty in sizes.items():
    for b in BUDGETS:
      losses = law(b, multiplier) + shift + penalty + noise * rng.standard_normal(seeds)
      out[(size, b)] = {'compute': b, 'losses': dict(enumerate(losses.tolist()))}
  return out


def test_fit_recovers_alpha_and_a_2x_multiplier_within_5_percent():
  result = ladder_lib.analyse({'base': cells_of(), 'fast': cells_of(2.0, rng_seed=2)}, 'base')
  assert result['e'] == 'own'  # five frontier points each
  base, fast = result['cells']['base'], result['cells']['fast']
  for cell in (base, fast):
    assert cell['fit']['alpha'] == pytest.approx(ALPHA, rel=0.05)
    assert cell['fit']['E'] == pytest.approx(E, rel=0.05)
  m = fast['multiplier']
  assert m['value'] == pytest.approx(2.0, rel=0.05)
  assert m['lo'] < 2.0 < m['hi'] and m['hi'] / m['lo'] < 1.5
  assert base['multiplier'] == {'value': 1.0, 'lo': 1.0, 'hi': 1.0}
  assert set(fast['by_budget']) == {f'{b:g}' for b in BUDGETS}
  # Four seeds paired: the smallest sign-flip p is 2/16, so no budget can separate.
  assert fast['verdict'] == 'n.s.'


def test_worse_at_every_budget_reads_worse_with_multiplier_below_1():
  sizes = {'medium': 0.0}
  result = ladder_lib.analyse({'base': cells_of(seeds=8, sizes=sizes),
                               'slow': cells_of(shift=0.05, seeds=8, sizes=sizes, rng_seed=3)},
                              'base')
  slow = result['cells']['slow']
  assert [e['verdict'] for e in slow['by_budget'].values()] == ['worse'] * len(BUDGETS)
  assert slow['verdict'] == 'worse'
  assert slow['multiplier']['hi'] < 1.0
  assert result['cells']['base']['verdict'] == 'baseline'


def test_the_same_run_twice_gives_the_same_interval():
  sizes = {'medium': 0.0}
  cells = {'base': cells_of(sizes=sizes), 'fast': cells_of(2.0, sizes=sizes, rng_seed=2)}
  assert ladder_lib.analyse(cells, 'base') == ladder_lib.analyse(cells, 'base')


@pytest.mark.parametrize('verdicts, expected', [
    (['better', 'better'], 'better'), (['worse', 'worse'], 'worse'),
    (['better', 'n.s.'], 'n.s.'), (['better', 'worse'], 'budget-dependent'),
    (['n.s.', 'better', 'worse'], 'budget-dependent'), (['n.s.'], 'n.s.')])
def test_overall_verdict_needs_every_budget(verdicts, expected):
  assert ladder_lib.overall(verdicts) == expected


def test_three_budgets_share_one_e():
  budgets = BUDGETS[:3]
  cells = {v: {k: c for k, c in cells_of(m).items() if k[1] in budgets}
           for v, m in (('base', 1.0), ('fast', 2.0))}
  result = ladder_lib.analyse(cells, 'base')
  assert result['e'] == 'shared'
  assert result['cells']['base']['fit']['E'] == result['cells']['fast']['fit']['E']


def test_bad_baseline_is_one_line():
  with pytest.raises(ValueError, match=r"--baseline='x' is not a variant.*valid: base") as e:
    ladder_lib.analyse({'base': cells_of()}, 'x')
  assert '\n' not in str(e.value)


def test_compare_on_a_ladder_sweep_dir_writes_the_ladder(tmp_path):
  sweep = tmp_path / 'sw'
  index, rng = {}, np.random.default_rng(0)
  for variant, multiplier in (('model.attention=dense', 1.0), ('model.attention=mla', 2.0)):
    for b in BUDGETS[:3]:
      name = f'ladder.flops={b!r},{variant},model.d_model=32'
      index[name] = {'variant': variant, 'size': 'model.d_model=32', 'flops': b}
      for seed in (0, 1):
        loss = law(b, multiplier) + 0.002 * rng.standard_normal()
        write_run(str(sweep / f'{name},seed={seed}'), [(10, 3.0), (100, loss)], [(100, loss)],
                  seed=seed, fields={'attention': variant[-3:], 'steps_for': b})
  (sweep / 'ladder.json').write_text(json.dumps(index))
  out = str(tmp_path / 'cmp.png')
  table = compare.compare([str(sweep)], out, baseline='model.attention=dense')
  assert 'Ladder (numbers in' in table
  result = json.loads(open(ladder_lib.ladder_path(out)).read())
  assert result['baseline'] == 'model.attention=dense'
  assert set(result['cells']) == {'model.attention=dense', 'model.attention=mla'}
  mla = result['cells']['model.attention=mla']
  assert set(mla) == {'fit', 'multiplier', 'by_budget', 'verdict'}
  assert mla['multiplier']['value'] == pytest.approx(2.0, rel=0.15)
  assert os.path.getsize(ladder_lib.ladder_path(out, '.png')) > 10_000
