"""tools.compare.extrapolation: the extrapolation table (mean [min, max] across seeds) and the loss
per position with seed bands, from eval.json files, also through tools.compare."""

import json
import os

import numpy as np

from tools.compare import comparison as compare
from tools.compare import extrapolation as extrapolation_compare
from tools.compare import runs as runs_lib
from tools.compare import summary as summary_lib

L = 8


def _load(root):
  return [runs_lib.load_run(w) for w in runs_lib.find_runs([str(root)])]


def _workdir(root, position, seed, scale):
  """A finished run with an eval.json at 1, 2, 4, 8 x L whose losses are `scale` x (1, 2, 3, 4)."""
  path = os.path.join(root, f'model.position={position},seed={seed}')
  os.makedirs(path)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'model': {'position': position}, 'train': {'seed': seed},
               'data': {'max_length': L}}, f)
  with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
    for step in (1, 2):
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': 3.0 - step}) + '\n')
  rows, curves = [], {}
  for i, k in enumerate((1, 2, 4, 8)):
    for mode in ('non_overlapping', 'sliding'):
      rows.append({'multiple': float(k), 'length': k * L, 'mode': mode,
                   'loss': scale * (i + 1) + (0.5 if mode == 'sliding' else 0.0),
                   'target_loss': 10 * scale * (i + 1)})
    curves[str(k * L)] = list(scale * (1.0 + np.arange(k * L) / L))
  with open(os.path.join(path, 'eval.json'), 'w') as f:
    json.dump({'extrapolation': rows, 'extrapolation_per_position': curves}, f)
  return path


def test_table_is_mean_min_max_of_the_seeds_ratios_and_target_losses(tmp_path):
  for seed, scale in enumerate((1.0, 2.0, 3.0)):
    _workdir(tmp_path, 'rope', seed, scale)
  _workdir(tmp_path, 'alibi', 0, 1.0)
  groups = summary_lib.group_runs(_load(tmp_path))
  table = extrapolation_compare.markdown_table(groups).splitlines()
  assert table[0] == ('| cell | seeds | loss at L | r2 | r4 | r8 | target loss 4L | '
                      'target loss 8L |')
  rope = next(l for l in table if l.startswith('| position=rope'))
  # loss at L: 1, 2, 3; r_k = (k-th loss) / loss at L is the same for every seed; target 4L = 30 s.
  assert rope == ('| position=rope | 3 | 2.000 [1.000, 3.000] | 2.000 [2.000, 2.000] | '
                  '3.000 [3.000, 3.000] | 4.000 [4.000, 4.000] | 60.000 [30.000, 90.000] | '
                  '80.000 [40.000, 120.000] |')
  assert '| position=alibi | 1 | 1.000 | 2.000 | 3.000 | 4.000 | 30.000 | 40.000 |' in table


def test_per_position_picture_has_a_seed_band_per_cell_and_panel(tmp_path):
  for seed, scale in enumerate((1.0, 2.0, 3.0)):
    _workdir(tmp_path, 'rope', seed, scale)
  _workdir(tmp_path, 'alibi', 0, 1.0)
  groups = summary_lib.group_runs(_load(tmp_path))
  fig, axes = extrapolation_compare.figure(groups)
  assert len(axes[0]) == 4  # windows of L, 2L, 4L, 8L
  for ax in axes[0]:
    assert len(ax.collections) == 1  # one band: rope's three seeds (alibi has one run)
    rope = next(line for line in ax.lines if line.get_label().startswith('rope'))
    band = ax.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() < rope.get_ydata().min() and band.max() > rope.get_ydata().max()
  # The mean across seeds at position 0 of the L panel is the mean of 1, 2, 3.
  first = next(line for line in axes[0][0].lines if line.get_label().startswith('rope'))
  assert first.get_ydata()[0] == 2.0
  # Short labels, as tools.compare's legend: the method's name and its seed count.
  curves = {line.get_label(): line for line in axes[0][0].lines if line.get_label()[0] != '_'}
  assert sorted(curves) == ['alibi (1)', 'rope (3)']
  # The second row divides by ALiBi's curve: ALiBi's own ratio is 1, rope's at position 0 is 2/1.
  assert len(axes) == 2
  ratios = {line.get_label(): line.get_ydata() for line in axes[1][0].lines
            if line.get_label()[0] != '_'}
  np.testing.assert_allclose(ratios['alibi'], 1.0)
  assert ratios['rope'][0] == 2.0
  # Rope's ratio (2) goes above the axis' top: cut there, marked, named; the styles differ.
  assert axes[1][0].get_ylim()[1] == extrapolation_compare.RATIO_TOP
  assert any(line.get_marker() == '^' for line in axes[1][0].lines)
  assert 'clipped: rope' in axes[1][0].texts[0].get_text()
  assert curves['alibi (1)'].get_linestyle() != curves['rope (3)'].get_linestyle()
  # Through tools.compare: the picture next to OUT and the table after the curves' table.
  out = str(tmp_path / 'cmp.png')
  text = compare.compare([str(tmp_path)], out)
  assert os.path.exists(str(tmp_path / 'cmp_extrapolation.png'))
  assert '| cell | seeds | loss at L | r2 |' in text


def test_fine_tunes_of_each_seed_s_own_source_form_one_group(tmp_path):
  for seed in (0, 1):
    path = _workdir(tmp_path, 'rope', seed, 1.0)
    with open(os.path.join(path, 'config.json')) as f:
      config = json.load(f)
    config['train']['init_from'] = f'/sweep/data.max_length=64,seed={seed}'
    with open(os.path.join(path, 'config.json'), 'w') as f:
      json.dump(config, f)
  groups = summary_lib.group_runs(_load(tmp_path))
  assert len(groups) == 1 and len(groups[0][1]) == 2


def _config(path, **fields):
  with open(os.path.join(path, 'config.json')) as f:
    config = json.load(f)
  for dotted, value in fields.items():
    section, key = dotted.split('.')
    config.setdefault(section, {})[key] = value
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(config, f)


def test_variants_get_rows_and_fine_tunes_are_compared_with_their_own_seed_s_base(tmp_path):
  """A variant's eval_FLAG.json is a row `cell [eval FLAG]`; with fine-tunes (train.init_from)
  the context-extension table gives each cell's loss at L and 4L (tokens) and 4L over the
  base's loss at L of the same seed."""
  for seed, scale in enumerate((1.0, 2.0)):
    base = _workdir(tmp_path, 'rope', seed, scale)  # L = 8: losses scale x 1, 2, 3 at 8, 16, 32
    with open(os.path.join(base, 'eval.json')) as f:
      result = json.load(f)
    for row in result['extrapolation']:
      row['loss'] *= 2  # the variant: twice the loss at every length
    with open(os.path.join(base, 'eval_rope_scaling=pi_4.json'), 'w') as f:
      json.dump(result, f)
    tune = os.path.join(tmp_path, f'model.position=rope,data.max_length=32,seed={seed}')
    os.makedirs(tune)
    with open(os.path.join(base, 'config.json')) as f:
      config = json.load(f)
    with open(os.path.join(tune, 'config.json'), 'w') as f:
      json.dump(config, f)
    _config(tune, **{'data.max_length': 32, 'train.init_from': os.path.join(str(tmp_path), 'b')})
    with open(os.path.join(tune, 'metrics.jsonl'), 'w') as f:
      f.write(json.dumps({'step': 1, 'split': 'train', 'loss': 1.0}) + '\n')
    with open(os.path.join(tune, 'eval.json'), 'w') as f:  # at 8 and 32 tokens: 0.5 and 1.5
      json.dump({'extrapolation': [
          {'multiple': m, 'length': int(32 * m), 'mode': 'non_overlapping', 'loss': loss}
          for m, loss in ((0.25, 0.5 * scale), (1.0, 1.5 * scale))]}, f)
  groups = summary_lib.group_runs(_load(tmp_path))
  table = extrapolation_compare.markdown_table(groups).splitlines()
  rows = {l.split(' | ')[0][2:]: l.split(' | ') for l in table if l.startswith('| max_length')}
  base, variant = rows['max_length=8,init_from='], rows['max_length=8,init_from= '
                                                         '[eval rope_scaling=pi_4]']
  assert base[2] == '1.500 [1.000, 2.000]' and variant[2] == '3.000 [2.000, 4.000]'  # loss at L
  head = next(i for i, l in enumerate(table) if l.startswith('| cell | seeds | loss at 8 (L)'))
  assert table[head] == '| cell | seeds | loss at 8 (L) | loss at 32 (4L) | 4L / base at L |'
  ext = {l.split(' | ')[0][2:]: l.split(' | ')[2:] for l in table[head + 2:] if l.startswith('| ')}
  assert ext['max_length=8,init_from='] == ['1.500 [1.000, 2.000]', '4.500 [3.000, 6.000]',
                                                '3.000 [3.000, 3.000] |']
  assert ext['max_length=8,init_from= [eval rope_scaling=pi_4]'][2] == '6.000 [6.000, 6.000] |'
  tune = next(v for k, v in ext.items() if 'max_length=32' in k)
  assert tune == ['0.750 [0.500, 1.000]', '2.250 [1.500, 3.000]', '1.500 [1.500, 1.500] |']


def test_the_ratio_axis_fits_every_method_when_none_is_far_worse(tmp_path):
  _workdir(tmp_path, 'rope', 0, 1.2)
  _workdir(tmp_path, 'alibi', 0, 1.0)
  _, axes = extrapolation_compare.figure(summary_lib.group_runs(_load(tmp_path)))
  top = axes[1][0].get_ylim()[1]
  assert 1.2 < top < 1.21 and not axes[1][0].texts  # rope's 1.2 is in view; nothing clipped
