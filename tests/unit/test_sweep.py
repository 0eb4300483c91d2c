"""Sweep files (tools/sweep/spec.py) and comparisons (tools/compare/comparison.py): expansion,
names, and the comparison's band (tools/compare/curves.py), divergence, plateau and steps-to-target
(tools/compare/summary.py) on synthetic runs."""

from tests.helpers import ROOT, write_run
import glob
import json
import os

import numpy as np
import pytest

from tools.compare import comparison as compare
from tools.compare import curves as curves_lib
from tools.compare import summary as summary_lib
from tools.sweep import spec as sweep_spec
from training import validation

ABLATIONS = sorted(glob.glob(os.path.join(ROOT, 'configs', 'ablations', '[!_]*.py')))


def test_grid_times_seeds_gives_sorted_stable_names():
  cells = sweep_spec.expand({'grid': {'train.warmup_steps': [0, 100],
                                      'model.norm_position': ['pre', 'post']},
                             'seeds': [0, 1]})
  assert len(cells) == 8
  assert cells[0]['name'] == 'model.norm_position=pre,train.warmup_steps=0,seed=0'
  assert cells[1]['name'] == 'model.norm_position=pre,train.warmup_steps=0,seed=1'
  assert cells[-1]['name'] == 'model.norm_position=post,train.warmup_steps=100,seed=1'
  assert cells[0]['overrides'] == {'train.warmup_steps': 0, 'model.norm_position': 'pre'}
  # The same grid written in another order names its cells the same way.
  again = sweep_spec.expand({'grid': {'model.norm_position': ['pre', 'post'],
                                      'train.warmup_steps': [0, 100]}, 'seeds': [0, 1]})
  assert sorted(c['name'] for c in again) == sorted(c['name'] for c in cells)
  # --seeds overrides the file's seeds.
  assert [c['seed'] for c in sweep_spec.expand({'seeds': [0, 1]}, seeds=['3'])] == [3]
  assert sweep_spec.expand({})[0]['name'] == 'seed=0'


def test_explicit_cells_crossed_with_grid_and_value_formatting():
  cells = sweep_spec.expand({'cells': [{'train.learning_rate': 1e-3},
                                       {'train.learning_rate': 2e-3, 'model.use_bias': True}],
                             'grid': {'model.norm_position': ['pre', 'post']}})
  assert [c['name'] for c in cells] == [
      'model.norm_position=pre,train.learning_rate=0.001,seed=0',
      'model.norm_position=post,train.learning_rate=0.001,seed=0',
      'model.norm_position=pre,model.use_bias=true,train.learning_rate=0.002,seed=0',
      'model.norm_position=post,model.use_bias=true,train.learning_rate=0.002,seed=0']
  assert sweep_spec.format_value(1e-5) == '1e-05' and sweep_spec.format_value(False) == 'false'


def test_names_are_filesystem_safe_and_bounded():
  name = sweep_spec.cell_name({'data.data_dir': '/a b/c', 'x': 'y' * 300}, 0)
  assert '/' not in name and ' ' not in name and len(name) <= sweep_spec.MAX_NAME
  assert name == sweep_spec.cell_name({'x': 'y' * 300, 'data.data_dir': '/a b/c'}, 0)
  assert name != sweep_spec.cell_name({'data.data_dir': '/a b/c', 'x': 'y' * 301}, 0)


@pytest.mark.parametrize('bad, message', [
    ({'grid': {'train.seed': [1, 2]}}, 'seeds'),
    ({'cells': [{'model.norm': 'rmsnorm'}, {'model.norm': 'rmsnorm'}]}, 'both named'),
    ({'cells': [{'model.norm': 'rmsnorm'}], 'grid': {'model.norm': ['layernorm']}}, 'both in'),
    ({'grids': {}}, 'unknown sweep keys'),
    ({'grid': {'model.norm': []}}, 'non-empty'),
])
def test_bad_sweeps_are_rejected(bad, message):
  with pytest.raises(sweep_spec.SweepError, match=message):
    sweep_spec.expand(bad)


@pytest.mark.parametrize('path', ABLATIONS, ids=os.path.basename)
def test_every_ablation_file_expands_into_valid_configs(path):
  module = sweep_spec.load_sweep_module(path)
  for arg in (None, 'quick', *getattr(module, 'OTHER_ARGS', ())):
    cells = sweep_spec.expand(sweep_spec.get_sweep(module, arg))
    assert cells
    for cell in cells:
      config = sweep_spec.cell_config(module, arg, cell)
      assert config.train.seed == cell['seed']
      for field, value in cell['overrides'].items():
        section, name = field.split('.')
        assert config[section][name] == value


def test_docs_sweeps_lists_every_sweep_file():
  with open(os.path.join(ROOT, 'docs/sweeps.md')) as f:
    listed = {line.split('`')[1] for line in f if line.startswith('| `') and '.py`' in line}
  assert {os.path.basename(p) for p in ABLATIONS} <= listed


def test_eval_flags_per_selected_cells_and_variants():
  """eval_flags as a list go to every cell; as a dict, a cell takes the flags of every selector it
  matches ('' matches all); each eval_variants flag adds a run of the same checkpoint."""
  sweep = {'cells': [{'data.max_length': 64}, {'data.max_length': 256}],
           'eval_flags': {'': ['--split=test'], 'data.max_length=64': ['--lengths=1,2,4,8'],
                          'data.max_length=256': ['--lengths=0.25,1']},
           'eval_variants': {'data.max_length=64': ['--rope_scaling=pi:4']}}
  short, long_ = sweep_spec.expand(sweep)
  runs = sweep_spec.eval_commands(sweep, 'D', short)
  assert [(suffix, argv[2:]) for suffix, argv in runs] == [
      ('rope_scaling=pi_4', [f'--workdir={os.path.join("D", short["name"])}', '--split=test',
                             '--lengths=1,2,4,8', '--rope_scaling=pi:4']),
      ('', [f'--workdir={os.path.join("D", short["name"])}', '--split=test',
            '--lengths=1,2,4,8'])]
  assert [argv[3:] for _, argv in sweep_spec.eval_commands(sweep, 'D', long_)] == [
      ['--split=test', '--lengths=0.25,1']]
  listed = dict(sweep, eval_flags=['--lengths=1'])
  assert [a[3:] for _, a in sweep_spec.eval_commands(listed, 'D', long_)] == [['--lengths=1']]
  with pytest.raises(sweep_spec.SweepError, match="eval_flags selector 'max_length' must be"):
    sweep_spec.expand(dict(sweep, eval_flags={'max_length': []}))


def test_postln_vs_preln_has_the_cells_of_the_study():
  module = sweep_spec.load_sweep_module(os.path.join(ROOT, 'configs', 'ablations',
                                                     'postln_vs_preln.py'))
  cells = sweep_spec.expand(sweep_spec.get_sweep(module))
  keys = {(c['overrides']['model.num_layers'], c['overrides']['train.learning_rate'],
           c['overrides']['train.steps'], c['overrides']['train.warmup_steps'],
           c['overrides']['model.norm_position']) for c in cells}
  assert keys == {(6, 2e-3, 500, 0, 'post'), (6, 2e-3, 500, 0, 'pre'),
                  (6, 2e-3, 1000, 100, 'post'), (6, 2e-3, 1000, 100, 'pre'),
                  (6, 2e-3, 1000, 0, 'pre'), (12, 1e-3, 500, 0, 'post'),
                  (12, 1e-3, 500, 0, 'pre'), (6, 1e-3, 500, 0, 'post'), (6, 1e-3, 500, 0, 'pre')}
  assert len(cells) == 27  # three seeds
  c = sweep_spec.cell_config(module, None, cells[0])
  assert (c.data.packing, c.train.loss_on, c.model.arch) == ('stream', 'all', 'decoder_only')
  assert (c.model.d_model, c.model.num_heads, c.train.b2, c.train.batch_size) == (64, 4, 0.999, 32)
  assert (c.data.max_length, c.train.schedule, c.train.grad_clip_norm) == (64, 'constant', 0.0)


def test_attention_sweep_names_every_registered_variant():
  """configs/ imports no layers: the sweep lists the variants as strings, this keeps it complete."""
  from layers import attention_variants
  module = sweep_spec.load_sweep_module(os.path.join(ROOT, 'configs', 'ablations',
                                                     'attention_variants.py'))
  cells = sweep_spec.expand(sweep_spec.get_sweep(module))
  # A causal-only variant is named by the decoder's field (its encoder is dense).
  named = {c['overrides'].get('model.decoder_attention') or c['overrides']['model.attention']
           for c in cells} | {c['overrides']['model.attention'] for c in cells}
  assert sorted(named) == sorted(attention_variants.VARIANTS)
  assert len(cells) == 3 * len(attention_variants.VARIANTS)  # three seeds
  for c in cells:  # every cell is a valid config (Linformer's decoder is dense)
    validation.validate(validation.resolve(sweep_spec.cell_config(module, None, c)))


def test_band_is_mean_min_max_across_seeds():
  a = (np.array([10, 20, 30]), np.array([3.0, 2.0, 1.0]))
  b = (np.array([10, 20, 30]), np.array([5.0, 4.0, np.nan]))
  c = (np.array([10, 20]), np.array([4.0, 3.0]))
  steps, mean, lo, hi = curves_lib.band([a, b, c])
  np.testing.assert_array_equal(steps, [10, 20, 30])
  np.testing.assert_allclose(mean, [4.0, 3.0, 1.0])
  np.testing.assert_allclose(lo, [3.0, 2.0, 1.0])
  np.testing.assert_allclose(hi, [5.0, 4.0, 1.0])


def test_divergence_rule():
  steps = np.arange(10, 101, 10)
  smooth = np.linspace(5, 2, 10)
  assert summary_lib.divergence(steps, smooth, 100) is None
  spike = smooth.copy()
  spike[6] = 2.1 * smooth[:6].min()
  assert summary_lib.divergence(steps, spike, 100) == 70
  nan = smooth.copy()
  nan[4] = float('nan')
  assert summary_lib.divergence(steps, nan, 100) == 50
  early = np.array([1.0, 3.0, 1.0, 0.9])  # a spike within the first 10% of the steps is allowed
  assert summary_lib.divergence(np.array([1, 5, 50, 100]), early, 100) is None


def test_plateau_rule():
  steps = np.arange(10, 101, 10)
  stuck = np.array([6.0, 5.0, 3.5, 3.46, 3.45, 3.45, 3.44, 3.43, 3.42, 3.41])  # 25%: step 30
  assert summary_lib.plateaued(steps, stuck, 100, level=3.3)  # 3.41 >= 0.95 * 3.5 and > 0.9 * 3.3
  # Converged below the unigram level:
  assert not summary_lib.plateaued(steps, stuck, 100, level=4.0)
  falling = np.linspace(6, 1, 10)
  assert not summary_lib.plateaued(steps, falling, 100, level=3.3)
  # Without the entropy the level is half the first loss (3.0 here): 3.41 > 0.9 * 3.33.
  assert summary_lib.plateaued(steps, stuck, 100, level=None)


def test_steps_to_target_and_smoothing():
  steps, losses = np.array([10, 20, 30, 40]), np.array([4.0, 3.1, 2.9, 3.0])
  assert summary_lib.steps_to_target(steps, losses, 3.0) == 30
  assert summary_lib.steps_to_target(steps, losses, 1.0) is None
  np.testing.assert_allclose(curves_lib.smooth(np.full(5, 2.0), 'ema:0.9'), 2.0)  # debiased
  np.testing.assert_allclose(curves_lib.smooth(np.array([1.0, 3.0, 5.0, 7.0]), 'ma:2'),
                             [1.0, 2.0, 4.0, 6.0])
  np.testing.assert_allclose(curves_lib.smooth(np.array([0.0, 1.0]), '0.5'), [0.0, 2.0 / 3.0])
  with pytest.raises(ValueError, match='valid forms'):
    curves_lib.smooth(np.ones(2), 'gauss:3')


def test_compare_groups_seeds_flags_and_tabulates(tmp_path):
  steps = list(range(10, 101, 10))
  for seed, shift in enumerate([0.0, 0.2]):
    write_run(tmp_path / f'sw/model.norm_position=pre,seed={seed}',
              [(s, 5.0 - 0.03 * s + shift) for s in steps],
              [(50, 3.6 + shift), (100, 2.0 + shift)], seed=seed,
              fields={'norm_position': 'pre'}, entropy=3.0)
  write_run(tmp_path / 'sw/model.norm_position=post,seed=0',
            [(s, 5.0 if s < 70 else float('nan')) for s in steps][:7], [(50, 5.0)],
            fields={'norm_position': 'post'}, entropy=3.0)
  write_run(tmp_path / 'sw/model.norm_position=mid,seed=0',
            [(s, max(4.0, 6.0 - 0.1 * s)) for s in steps], [(50, 4.1), (100, 4.0)],
            fields={'norm_position': 'mid'}, entropy=3.0)
  out = tmp_path / 'cmp.png'
  table = compare.compare([str(tmp_path / 'sw')], str(out), smoothing='ema:0.5', logy=True,
                          target_loss=3.7)
  assert out.exists() and out.stat().st_size > 10000
  rows = {line.split(' | ')[0][2:]: line for line in table.splitlines() if line.startswith('| n')}
  assert set(rows) == {'norm_position=pre', 'norm_position=post', 'norm_position=mid'}
  pre = rows['norm_position=pre'].split(' | ')
  assert pre[1] == '2'  # two seeds, one row
  assert pre[2] == '2.1000 [2.0000, 2.2000]'  # final training loss (step 100): 2.0 and 2.2
  assert pre[3] == '2.1000 [2.0000, 2.2000]'  # final validation loss: mean [min, max]
  assert pre[5] == '75 [50, 100] (2/2)'  # steps to valid <= 3.7: 50 (seed 0) and 100 (seed 1)
  assert pre[7] == '1,000' and pre[8] == 'ok |'
  assert 'DIVERGED 1/1 (step 70)' in rows['norm_position=post']
  assert 'PLATEAU 1/1' in rows['norm_position=mid']
  assert 'never (0/1)' in rows['norm_position=mid']


def test_compare_steps_to_a_training_loss_and_the_init_gradient_ratio(tmp_path):
  """--target_split=train reads the training curve (logged every few steps); the init gradient
  column is the first block's norm over the last block's, mean [min, max] across seeds."""
  for seed, (first, last) in enumerate([(1.0, 4.0), (3.0, 4.0)]):
    workdir = tmp_path / f'sw/model.norm_position=post,seed={seed}'
    write_run(workdir, [(s, 5.0 - 0.02 * s - seed) for s in range(10, 101, 10)],
              [(50, 3.9), (100, 3.0)], seed=seed, fields={'norm_position': 'post'})
    (workdir / 'init_grad_norms.json').write_text(
        json.dumps({'blocks': [first, 2.0, last], 'groups': {}}))
  table = compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'cmp.png'), target_loss=3.9,
                          target_split='train')
  head, _, row = [line.split(' | ') for line in table.splitlines()[:3]]
  assert head[5:7] == ['steps to train <= 3.9', 'init grad first/last block']
  assert row[5] == '35 [10, 60] (2/2)'  # 5 - 0.02 s <= 3.9 from s = 60, 4 - 0.02 s from s = 10
  assert row[6] == '0.5 [0.25, 0.75]'
  with pytest.raises(ValueError, match='target_split'):
    compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'cmp.png'), target_loss=3.9,
                    target_split='test')


def test_compare_reads_separate_workdirs_and_reports_missing(tmp_path):
  write_run(tmp_path / 'a', [(10, 3.0), (20, 2.0)], steps=20, fields={'ffn': 'relu'})
  write_run(tmp_path / 'b', [(10, 3.0), (20, 2.5)], steps=20, fields={'ffn': 'gelu'})
  table = compare.compare([str(tmp_path / 'a'), str(tmp_path / 'b')], str(tmp_path / 'c.png'))
  assert '| ffn=relu | 1 |' in table and '| ffn=gelu | 1 |' in table
  with pytest.raises(FileNotFoundError, match='neither'):
    compare.compare([str(tmp_path / 'nope')], str(tmp_path / 'c.png'))


def test_compare_fills_fields_added_since_with_their_defaults(tmp_path):
  """A sweep whose later cells were written by a newer attnlab (one more field, at its default)
  still groups its seeds together."""
  for seed, fields in enumerate([{'norm_position': 'post'},
                                 {'norm_position': 'post', 'scan_layers': False}]):
    write_run(tmp_path / f'sw/model.norm_position=post,seed={seed}',
              [(s, 4.0 - 0.01 * s) for s in range(10, 101, 10)], [(100, 3.0)], seed=seed,
              fields=fields)
  table = compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'cmp.png'))
  first = table.split('\n\n')[0]  # the summary table (the statistics table follows)
  rows = [line for line in first.splitlines() if line.startswith('| ') and '---' not in line][1:]
  assert len(rows) == 1 and rows[0].split(' | ')[1] == '2', table


def test_short_forms_keep_the_full_forms_cells_at_a_smaller_budget():
  """attention_2024's `short` forms run the `code` and `stability` cells with fewer tokens a step
  and fewer steps, and nothing else changed; `sinks` is the short code form's first three cells
  (whose finished runs a short code sweep into the same directory then skips)."""
  module = sweep_spec.load_sweep_module(os.path.join(ROOT, 'configs', 'ablations',
                                                     'attention_2024.py'))
  for form in ('code', 'stability'):
    full, short = (sweep_spec.expand(sweep_spec.get_sweep(module, arg))
                   for arg in (form, f'{form},short'))
    assert [c['name'] for c in short] == [c['name'] for c in full]
    full_config, short_config = (sweep_spec.cell_config(module, arg, short[0])
                                 for arg in (form, f'{form},short'))
    assert (short_config.train.batch_size, short_config.train.steps) == (
        module.SHORT_BATCH, module.SHORT_STEPS)
    assert short_config.train.steps < full_config.train.steps
    assert short_config.train.batch_size < full_config.train.batch_size
    for config in (full_config, short_config):
      config.train.batch_size = config.train.steps = config.train.warmup_steps = 0
    assert short_config == full_config
  sinks = sweep_spec.expand(sweep_spec.get_sweep(module, 'sinks'))
  short_code = sweep_spec.expand(sweep_spec.get_sweep(module, 'code,short'))
  assert len(sinks) == 9  # dense, the gate and the sinks, 3 seeds each
  assert [c['name'] for c in sinks] == [c['name'] for c in short_code][:len(sinks)]
  assert (sweep_spec.cell_config(module, 'sinks', sinks[0]) ==
          sweep_spec.cell_config(module, 'code,short', sinks[0]))
  with pytest.raises(ValueError, match="short shortens the code and stability forms; valid: "
                     "'code,short', 'stability,short'"):
    module.get_config('short')  # the recall form has no short budget: not silently the full one
