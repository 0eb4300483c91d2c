"""The pictures: short legend labels (tools/compare/legend.py), colour and line-style assignment
(tools/compare/group_styles.py) and bands (tools/compare/curves.py), the comparison's legend
placement (tools/compare/figure.py), the extrapolation and attention pictures
(tools/plots/run_pictures.py). No processes, no training: synthetic runs and arrays."""

import json
import os
import types

import matplotlib
import numpy as np
import pytest

from tools.compare import comparison as compare
from tools.compare import figure as compare_figure
from tools.compare import curves as curves_lib
from tools.compare import group_styles
from tools.compare import legend
from tools.plots import style as plot_style
from tools.plots import run_pictures as plots
from tools.compare import runs as runs_lib
from tools.compare import summary as summary_lib

matplotlib.use('Agg')
import matplotlib.pyplot as plt

# The Post-LN vs Pre-LN study (configs/ablations/postln_vs_preln.py): 9 cells.
SETTINGS = [(6, 2e-3, 500, 0, ('post', 'pre')), (6, 2e-3, 1000, 100, ('post', 'pre')),
            (6, 2e-3, 1000, 0, ('pre',)), (12, 1e-3, 500, 0, ('post', 'pre')),
            (6, 1e-3, 500, 0, ('post', 'pre'))]
STUDY_FIELDS = ['model.norm_position', 'model.num_layers', 'train.learning_rate', 'train.steps',
                'train.warmup_steps']


def study_configs():
  return [{'model.num_layers': layers, 'model.norm_position': norm, 'train.learning_rate': lr,
           'train.steps': steps, 'train.warmup_steps': warmup, 'model.d_model': 64}
          for layers, lr, steps, warmup, norms in SETTINGS for norm in norms]


# --- labels ---------------------------------------------------------------------------------------

def test_values_read_short():
  assert [legend._num(v) for v in (0.001, 0.0025, 5e-4, 0.05, 0.5, 6, 1e-5)] == [
      '1e-3', '2.5e-3', '5e-4', '0.05', '0.5', '6', '1e-5']
  assert [legend._count(v) for v in (500, 1000, 1500, 20000, 1234, 2_000_000)] == [
      '500', '1k', '1.5k', '20k', '1234', '2M']
  assert legend.abbreviate('model.num_layers', 12) == '12L'
  assert legend.abbreviate('train.learning_rate', 0.001) == 'lr 1e-3'
  assert legend.abbreviate('train.warmup_steps', 0) == 'no warmup'
  assert legend.abbreviate('train.warmup_steps', 100) == 'warmup 100'
  assert legend.abbreviate('train.steps', 1000) == '1k steps'
  assert legend.abbreviate('model.norm_position', 'post') == 'post'
  assert legend.abbreviate('model.rope_scaling_factor', 4.0) == 'x4'
  assert legend.abbreviate('model.rope_scaling', 'none') == 'no scaling'
  assert legend.abbreviate('model.rope_scaling', 'yarn') == 'yarn scaling'
  assert legend.abbreviate('train.init_from', 'runs/extend/model.position=rope,seed=0') == (
      'from model.position=rope,seed=0')
  assert legend.abbreviate('train.init_from', '') == ''
  # Fields without an abbreviation keep their last name; booleans read as a word or its negation.
  assert legend.abbreviate('model.fire_threshold', 64.0) == 'fire_threshold=64'
  assert legend.abbreviate('model.scan_layers', True) == 'scan_layers'
  assert legend.abbreviate('model.scan_layers', False) == 'no scan_layers'


def test_labels_name_only_the_fields_that_differ():
  """The issue's example: four fields differ (seed and data_dir do not count), d_model does not."""
  configs = [{'model.norm_position': norm, 'model.num_layers': layers, 'train.learning_rate': lr,
              'train.warmup_steps': warmup, 'model.d_model': 64, 'train.seed': seed,
              'data.data_dir': f'/data{seed}'}
             for seed, (norm, layers, lr, warmup) in enumerate([('post', 12, 1e-3, 0),
                                                                ('pre', 12, 1e-3, 0),
                                                                ('post', 6, 2e-3, 100)])]
  fields = runs_lib.differing_fields([{'config': c} for c in configs])
  assert fields == ['model.norm_position', 'model.num_layers', 'train.learning_rate',
                    'train.warmup_steps']
  labels, note = legend.legend_labels(configs, fields, [['plateau'], [], ['diverged 1/3']])
  assert labels == ['post · 12L · lr 1e-3 · no warmup · plateau', 'pre · 12L · lr 1e-3 · no warmup',
                    'post · 6L · lr 2e-3 · warmup 100 · diverged 1/3']
  assert note == ''



def test_kv_heads_as_many_as_the_heads_read_as_nothing():
  configs = [{'model.attention': a, 'model.num_heads': 4, 'model.num_kv_heads': k}
             for a, k in (('dense', 4), ('dense', 2), ('dense', 1), ('linear', 4))]
  labels, _ = legend.legend_labels(configs, ['model.attention', 'model.num_kv_heads'])
  assert labels == ['dense', 'dense · 2 kv heads', 'dense · 1 kv head', 'linear']

def test_long_labels_leave_out_each_fields_most_common_value():
  """The study's nine cells differ in five fields: full labels run to 44 characters (flags aside),
  so the common value of each field outside colour and style (lr 2e-3, 500 steps, no warmup) is
  named once."""
  configs = study_configs()
  flags = [['plateau 2/3'] if c['model.norm_position'] == 'post' and c['train.steps'] == 500 and
           c['train.learning_rate'] == 2e-3 else ['plateau'] if c['model.num_layers'] == 12 and
           c['model.norm_position'] == 'post' else [] for c in configs]
  full, _ = legend.legend_labels(configs, STUDY_FIELDS, max_len=1000)
  assert max(map(len, full)) == 44 > legend.MAX_LABEL
  labels, note = legend.legend_labels(configs, STUDY_FIELDS, flags,
                                      keep=('model.norm_position', 'model.num_layers'))
  assert note == 'unless noted: lr 2e-3 · 500 steps · no warmup'
  assert labels == ['post · 6L · plateau 2/3', 'pre · 6L',
                    'post · 6L · 1k steps · warmup 100', 'pre · 6L · 1k steps · warmup 100',
                    'pre · 6L · 1k steps',
                    'post · 12L · lr 1e-3 · plateau', 'pre · 12L · lr 1e-3',
                    'post · 6L · lr 1e-3', 'pre · 6L · lr 1e-3']
  assert max(map(len, labels)) <= legend.MAX_LABEL and len(set(labels)) == len(labels)
  # A kept field stays even at its common value; a value held by one group only is never dropped.
  labels, note = legend.legend_labels(configs[:2] + configs[5:6], STUDY_FIELDS, max_len=10,
                                      keep=('model.norm_position',))
  assert note == 'unless noted: 6L · lr 2e-3 · 500 steps · no warmup'
  assert labels == ['post', 'pre', 'post · 12L · lr 1e-3']
  # Nothing kept: the group at every common value is named by them, not left blank.
  flags = [['plateau'], [], []]
  labels, note = legend.legend_labels(configs[:2] + configs[5:6], STUDY_FIELDS, flags,
                                      max_len=10)
  assert note == 'unless noted: post · 6L · lr 2e-3 · 500 steps · no warmup'
  assert labels == ['post · 6L · lr 2e-3 · 500 steps · no warmup · plateau', 'pre',
                    '12L · lr 1e-3']


# --- colour and line style ------------------------------------------------------------------------

def test_default_colour_goes_to_the_fewest_values_then_the_most_contrasts():
  configs = study_configs()
  # Every study field has two values; norm_position is the one whose values pair up the cells
  # (4 pairs differ in it alone, vs 2 for num_layers and learning_rate, 1 for steps and warmup).
  assert group_styles.rank_fields(configs, STUDY_FIELDS)[0] == 'model.norm_position'
  color, style = group_styles.choose_style_fields(configs, STUDY_FIELDS)
  assert color == 'model.norm_position' and style in STUDY_FIELDS and style != color
  # Fewer values win over contrasts: 3 attention variants x 2 norms -> colour by norm.
  grid = [{'model.attention': a, 'model.norm': n} for a in ('dense', 'linformer', 'performer')
          for n in ('layernorm', 'rmsnorm')]
  fields = ['model.attention', 'model.norm']
  assert group_styles.choose_style_fields(grid, fields) == ('model.norm', 'model.attention')
  # Colour alone tells the groups apart: no line style.
  ffns = [{'model.ffn': f} for f in ('relu', 'gelu', 'swiglu')]
  assert group_styles.choose_style_fields(ffns, ['model.ffn']) == ('model.ffn', None)
  # Named fields: dotted or last part; none; an unknown or constant field is refused with the list.
  assert group_styles.choose_style_fields(configs, STUDY_FIELDS, 'num_layers', 'none') == (
      'model.num_layers', None)
  assert group_styles.choose_style_fields(configs, STUDY_FIELDS, 'none', 'model.norm_position') == (
      None, 'model.norm_position')
  with pytest.raises(ValueError, match='fields that differ: model.norm_position, model.num_layers'):
    group_styles.choose_style_fields(configs, STUDY_FIELDS, 'model.d_model')
  many = [{'train.learning_rate': lr} for lr in (1e-4, 2e-4, 5e-4, 1e-3, 2e-3)]
  with pytest.raises(ValueError, match='5 values'):
    group_styles.choose_style_fields(many, ['train.learning_rate'], 'none', 'learning_rate')


def test_hue_by_colour_field_style_by_style_field_shade_by_the_rest():
  configs = study_configs()
  styles = group_styles.assign_styles(configs, STUDY_FIELDS, 'model.norm_position',
                                      'model.num_layers')
  for c, s in zip(configs, styles):
    assert s['hue'] == {'post': 0, 'pre': 1}[c['model.norm_position']]
    assert s['linestyle'] == {6: '-', 12: '--'}[c['model.num_layers']]
  # Every group is told apart by its colour and line style.
  assert len({(s['color'], s['linestyle']) for s in styles}) == len(configs)
  # The same setting has the same shade under both hues; shades run dark to light.
  rest = lambda c: (c['train.learning_rate'], c['train.steps'], c['train.warmup_steps'])  # noqa
  for a, sa in zip(configs, styles):
    for b, sb in zip(configs, styles):
      assert (sa['shade'] == sb['shade']) == (rest(a) == rest(b))
  darkest = [s for s in styles if s['shade'] == 0 and s['hue'] == 0][0]
  lightest = [s for s in styles if s['shade'] == 3 and s['hue'] == 0][0]
  assert sum(darkest['color']) < sum(matplotlib.colors.to_rgb(group_styles.PALETTE[0])) < sum(
      lightest['color'])
  # Without a colour field each group has its own base hue, all solid.
  plain = group_styles.assign_styles(configs[:3], STUDY_FIELDS)
  palette = [matplotlib.colors.to_rgb(c) for c in group_styles.PALETTE[:3]]
  assert [s['color'] for s in plain] == palette
  assert {s['linestyle'] for s in plain} == {'-'}


def test_band_kinds():
  a = (np.array([10, 20]), np.array([1.0, 2.0]))
  b = (np.array([10, 20]), np.array([3.0, 6.0]))
  _, mean, lo, hi = curves_lib.band([a, b], 'std')
  np.testing.assert_allclose(mean, [2.0, 4.0])
  np.testing.assert_allclose(lo, [1.0, 2.0])
  np.testing.assert_allclose(hi, [3.0, 6.0])
  _, mean, lo, hi = curves_lib.band([a, b], 'none')
  np.testing.assert_allclose(lo, mean) and np.testing.assert_allclose(hi, mean)
  with pytest.raises(ValueError, match='minmax, std, none'):
    curves_lib.band([a], 'iqr')


# --- the comparison figure ------------------------------------------------------------------------

def write_run(workdir, config, losses, init_grad=None, entropy=4.38):
  os.makedirs(workdir, exist_ok=True)
  steps = len(losses) * 10
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for i, loss in enumerate(losses):
      f.write(json.dumps({'step': 10 * (i + 1), 'split': 'train', 'loss': loss}) + '\n')
    f.write(json.dumps({'step': steps, 'split': 'valid', 'loss': losses[-1]}) + '\n')
  nested = {}
  for key, value in config.items():
    section, name = key.split('.')
    nested.setdefault(section, {})[name] = value
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(nested, f)
  with open(os.path.join(workdir, 'run_info.json'), 'w') as f:
    json.dump({'num_params': 1000, 'unigram_entropy': entropy}, f)
  if init_grad is not None:
    with open(os.path.join(workdir, 'init_grad_norms.json'), 'w') as f:
      json.dump({'blocks': init_grad}, f)


def write_study(root, with_init=True):
  for c in study_configs():
    stuck = c['model.norm_position'] == 'post' and c['model.num_layers'] == 12
    n = c['train.steps'] // 100
    for seed in (0, 1):
      losses = [4.4 + 0.01 * seed] * n if stuck else list(np.linspace(5.0, 1.3 + 0.05 * seed, n))
      # Init gradients depend on the model only: cells differing in training settings share them.
      top = 1.8 if c['model.norm_position'] == 'post' else 0.5
      grad = list(np.linspace(0.6, top, c['model.num_layers']) + 0.1 * seed)
      name = ','.join(f'{k}={v}' for k, v in sorted(c.items())) + f',seed={seed}'
      write_run(os.path.join(root, name), {**c, 'train.seed': seed}, losses,
                grad if with_init else None)


def overlaps(a, b):
  return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize('with_init', [True, False])
def test_one_legend_outside_every_panel(tmp_path, with_init):
  write_study(str(tmp_path), with_init)
  runs = [runs_lib.load_run(w) for w in runs_lib.find_runs([str(tmp_path)])]
  groups = summary_lib.group_runs(runs)
  summary = summary_lib.summarize(groups)
  fig, labels = compare_figure.figure(groups, summary, logy=True,
                                      color_by='model.norm_position', style_by='model.num_layers')
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  panels = [ax for ax in fig.axes if ax.axison]
  assert len(panels) == (3 if with_init else 2)
  legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
  assert len(legends) == 1  # one legend for all panels
  box = legends[0].get_window_extent(renderer)
  for ax in panels:
    assert not overlaps(box, ax.get_window_extent(renderer)), ax.get_title()
    assert not overlaps(box, ax.get_tightbbox(renderer)), ax.get_title()  # nor their tick labels
  assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and 0 <= box.y0 and box.y1 <= fig.bbox.y1
  texts = [t.get_text() for t in legends[0].get_texts()]
  assert sorted(texts) == sorted(labels) and max(map(len, texts)) <= legend.MAX_LABEL
  assert 'post · 12L · lr 1e-3 · plateau' in texts
  assert legends[0].get_title().get_text() == (
      'mean of 2 seeds, band: min to max\nunless noted: lr 2e-3 · 500 steps · no warmup')
  # The handles carry the colour field's hue and the style field's line style.
  handles = dict(zip(texts, legends[0].legend_handles))
  assert handles['post · 12L · lr 1e-3 · plateau'].get_linestyle() == '--'
  assert handles['post · 6L · lr 1e-3'].get_linestyle() == '-'
  assert fig.get_figwidth() == plot_style.WIDTH
  if with_init:  # drawn once per model (post/pre x 6/12 layers), not once per cell
    init = [ax for ax in panels if ax.get_title() == 'gradient norm at initialisation'][0]
    assert sorted(len(l.get_xdata()) for l in init.get_lines()) == [6, 6, 12, 12]
  plt.close(fig)


def test_compare_writes_the_png_and_refuses_bad_options(tmp_path):
  write_study(str(tmp_path / 'sw'))
  out = tmp_path / 'cmp.png'
  table = compare.compare([str(tmp_path / 'sw')], str(out), band_kind='std', color_by='num_layers')
  assert out.stat().st_size > 20000
  # The table keeps the full overrides.
  assert ('| norm_position=post,num_layers=12,learning_rate=0.001,steps=500,warmup_steps=0 | 2 |'
          in table)
  with pytest.raises(ValueError, match='--band'):
    compare.compare([str(tmp_path / 'sw')], str(out), band_kind='range')
  with pytest.raises(ValueError, match='--color_by=d_model'):
    compare.compare([str(tmp_path / 'sw')], str(out), color_by='d_model')


def test_compare_draws_and_tabulates_logged_metrics(tmp_path):
  """--metrics: one panel per metric (OUT_metrics.png) and a table of each group's run mean and
  last value, mean [min, max] across seeds; a metric no run logged is one line naming those
  logged."""
  for cell, cv in (('a', 1.0), ('b', 0.5)):
    for seed in (0, 1):
      workdir = tmp_path / 'sw' / f'{cell}_{seed}'
      write_run(str(workdir), {'model.moe_bias_rate': 0.0 if cell == 'a' else 1e-3,
                               'train.seed': seed}, [4.0, 3.9, 3.8])
      rows = [{'step': s, 'split': 'train', 'loss': 4.0, 'moe_load_cv': cv * (1 + seed) / s * 10}
              for s in (10, 20, 30)]
      with open(workdir / 'metrics.jsonl', 'w') as f:
        f.write('\n'.join(json.dumps(r) for r in rows) + '\n')
  out = tmp_path / 'cmp.png'
  table = compare.compare([str(tmp_path / 'sw')], str(out), metrics=['moe_load_cv'])
  assert (tmp_path / 'cmp_metrics.png').stat().st_size > 10000
  # Cell a: run means (1 + 0.5 + 1/3)/3 = 0.611 and twice that; last values 0.333 and 0.667.
  assert '| moe_bias_rate=0.0 | 0.917 [0.611, 1.22] | 0.5 [0.333, 0.667] |' in table
  with pytest.raises(ValueError, match=r"^--metrics: no run logged 'moe_drop_fraction'; logged: "
                                       r'loss, moe_load_cv$'):
    compare.compare([str(tmp_path / 'sw')], str(out), metrics=['moe_drop_fraction'])


# --- tools/plots/run_pictures.py ------------------------------------------------------------------

def test_extrapolation_plot_draws_one_line_per_length_and_marks_the_training_length(tmp_path):
  rng = np.random.default_rng(0)
  per_position = {n: rng.random(n) for n in (128, 64, 256)}
  fig = plots.per_position_figure(per_position, 'rope', train_length=64)
  ax = fig.axes[0]
  lines = [l for l in ax.get_lines() if not l.get_label().startswith('_')]
  assert [l.get_label() for l in lines] == ['window 64 (1x)', 'window 128 (2x)', 'window 256 (4x)']
  np.testing.assert_allclose(lines[0].get_ydata(), per_position[64])  # at L: unsmoothed
  np.testing.assert_allclose(lines[1].get_ydata(),  # at 2L: means of 2 positions
                             np.convolve(per_position[128], [0.5, 0.5], mode='valid'))
  marks = [l for l in ax.get_lines() if l.get_label().startswith('_')]
  assert len(marks) == 1 and list(marks[0].get_xdata()) == [64, 64]
  assert any('training length 64' in t.get_text() for t in ax.texts)
  fig.canvas.draw()
  renderer = fig.canvas.get_renderer()
  assert len(fig.legends) == 1 and not overlaps(fig.legends[0].get_window_extent(renderer),
                                                ax.get_window_extent(renderer))
  plt.close(fig)
  path = plots.plot_per_position(str(tmp_path), per_position, 'rope', train_length=64)
  assert path.endswith('extrapolation.png') and os.path.getsize(path) > 10000


def test_attention_heads_share_one_colour_scale_and_name_their_tokens():
  rng = np.random.default_rng(0)
  rows, cols = ['<bos>', 'der', 'hund'], ['the', 'dog', 'runs', '</s>']
  weights = rng.random((3, 3, 4)) * np.array([1.0, 0.5, 0.2])[:, None, None]  # [N, T, S]
  fig = plots.attention_figure(weights, rows, cols, 'cross: the dog runs')
  images = [im for ax in fig.axes for im in ax.get_images()]
  assert len(images) == 3
  assert len({id(im.norm) for im in images}) == 1  # one scale ...
  assert images[0].norm.vmin == 0.0 and images[0].norm.vmax == pytest.approx(weights.max())
  colorbars = [ax for ax in fig.axes if ax.get_label() == '<colorbar>']
  assert len(colorbars) == 1  # ... and one colorbar
  heads = [ax for ax in fig.axes if ax.get_images()]
  for h, ax in enumerate(heads):
    np.testing.assert_allclose(ax.get_images()[0].get_array(), weights[h])
    assert [t.get_text() for t in ax.get_xticklabels()] == cols
  assert [t.get_text() for t in heads[0].get_yticklabels()] == rows
  plt.close(fig)


def test_plot_attention_maps_writes_one_picture_per_kind(tmp_path):
  """encoder_decoder: self- and cross-attention of the last layer, from a stand-in model."""
  tokens = ['<pad>', '<bos>', '</s>', '<sep>', 'the', 'dog', 'der', 'hund']
  tokenizer = types.SimpleNamespace(tokens=tokens, bos_id=1, eos_id=2, sep_id=3)
  config = types.SimpleNamespace(model=types.SimpleNamespace(arch='encoder_decoder'))
  example = {'source_ids': [4, 5], 'target_ids': [6, 7], 'source': 'the dog'}
  seen = {}

  def attention_weights(batch):
    seen.update(batch)
    t, s = batch['tgt_inputs'].shape[1], batch['src_inputs'].shape[1]
    return [[('self', np.full((1, 2, t, t), 1.0 / t)), ('cross', np.full((1, 2, t, s), 1.0 / s))]]

  model = types.SimpleNamespace(attention_weights=attention_weights)
  paths = plots.plot_attention_maps(str(tmp_path), config, model, [example], tokenizer)
  assert [os.path.basename(p) for p in paths] == ['attention_0_self.png', 'attention_0_cross.png']
  assert all(os.path.getsize(p) > 5000 for p in paths)
  np.testing.assert_array_equal(seen['src_inputs'], [[4, 5, 2]])
  np.testing.assert_array_equal(seen['tgt_inputs'], [[1, 6, 7]])


def test_write_eval_outputs_marks_the_runs_training_length(tmp_path, monkeypatch):
  """eval.py's pictures: the extrapolation plot marks config.data.max_length as training length."""
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for step, loss in ((10, 3.0), (20, 2.0)):
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': loss}) + '\n')
  config = types.SimpleNamespace(model=types.SimpleNamespace(position='alibi'),
                                 data=types.SimpleNamespace(max_length=32))
  run = types.SimpleNamespace(config=config, per_position={32: np.ones(32), 64: np.ones(64)})
  seen = {}
  figure = plots.per_position_figure

  def spy(per_position, title, train_length=None):
    seen.update(title=title, train_length=train_length)
    return figure(per_position, title, train_length)

  monkeypatch.setattr(plots, 'per_position_figure', spy)
  result = plots.write_eval_outputs(str(tmp_path), {'rope_scaling': 'as trained'}, run, ['test'])
  assert seen == {'title': 'alibi, rope_scaling=as trained', 'train_length': 32}
  assert os.path.getsize(result['extrapolation_plot']) > 10000
  assert os.path.getsize(result['loss_curve']) > 10000
  with open(tmp_path / 'eval.json') as f:
    assert json.load(f)['extrapolation_plot'] == result['extrapolation_plot']


def test_the_loss_curve_reads_its_log_ticks_as_plain_numbers(tmp_path, monkeypatch):
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for step, loss in ((10, 5.8), (20, 4.1), (30, 2.3)):
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': loss}) + '\n')
  seen = {}
  save = plots._save

  def spy(fig, ax, path):
    fig.canvas.draw()
    seen['labels'] = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    return save(fig, ax, path)

  monkeypatch.setattr(plots, '_save', spy)
  plots.plot_loss_curve(str(tmp_path))
  assert seen['labels'] and all(float(t) > 0 for t in seen['labels']), seen  # not 6x10^0
