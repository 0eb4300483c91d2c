"""Sweeps (tools/sweep.py) and comparisons (tools/compare.py): expansion, names, skip/resume,
--dry_run, and the comparison's band, divergence, plateau and steps-to-target on synthetic runs."""

import glob
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from tools import compare
from tools import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABLATIONS = sorted(glob.glob(os.path.join(ROOT, 'configs', 'ablations', '[!_]*.py')))

TINY_SWEEP = '''
from configs import decoder_only


def get_config(arg=None):
  config = decoder_only.get_config('quick')
  config.train.steps = 20
  return config


def get_sweep():
  return {GRID}
'''


def write_sweep(tmp_path, grid):
  path = tmp_path / 'tiny_sweep.py'
  path.write_text(TINY_SWEEP.replace('{GRID}', grid))
  return str(path)


# --- expansion and names -------------------------------------------------------------------------

def test_grid_times_seeds_gives_sorted_stable_names():
  cells = sweep.expand({'grid': {'train.warmup_steps': [0, 100], 'model.norm_position': ['pre',
                                                                                        'post']},
                        'seeds': [0, 1]})
  assert len(cells) == 8
  assert cells[0]['name'] == 'model.norm_position=pre,train.warmup_steps=0,seed=0'
  assert cells[1]['name'] == 'model.norm_position=pre,train.warmup_steps=0,seed=1'
  assert cells[-1]['name'] == 'model.norm_position=post,train.warmup_steps=100,seed=1'
  assert cells[0]['overrides'] == {'train.warmup_steps': 0, 'model.norm_position': 'pre'}
  # The same grid written in another order names its cells the same way.
  again = sweep.expand({'grid': {'model.norm_position': ['pre', 'post'],
                                 'train.warmup_steps': [0, 100]}, 'seeds': [0, 1]})
  assert sorted(c['name'] for c in again) == sorted(c['name'] for c in cells)
  # --seeds overrides the file's seeds.
  assert [c['seed'] for c in sweep.expand({'seeds': [0, 1]}, seeds=['3'])] == [3]
  assert sweep.expand({})[0]['name'] == 'seed=0'


def test_explicit_cells_crossed_with_grid_and_value_formatting():
  cells = sweep.expand({'cells': [{'train.learning_rate': 1e-3}, {'train.learning_rate': 2e-3,
                                                                  'model.use_bias': True}],
                        'grid': {'model.norm_position': ['pre', 'post']}})
  assert [c['name'] for c in cells] == [
      'model.norm_position=pre,train.learning_rate=0.001,seed=0',
      'model.norm_position=post,train.learning_rate=0.001,seed=0',
      'model.norm_position=pre,model.use_bias=true,train.learning_rate=0.002,seed=0',
      'model.norm_position=post,model.use_bias=true,train.learning_rate=0.002,seed=0']
  assert sweep.format_value(1e-5) == '1e-05' and sweep.format_value(False) == 'false'


def test_names_are_filesystem_safe_and_bounded():
  name = sweep.cell_name({'data.data_dir': '/a b/c', 'x': 'y' * 300}, 0)
  assert '/' not in name and ' ' not in name and len(name) <= sweep.MAX_NAME
  assert name == sweep.cell_name({'x': 'y' * 300, 'data.data_dir': '/a b/c'}, 0)
  assert name != sweep.cell_name({'data.data_dir': '/a b/c', 'x': 'y' * 301}, 0)


@pytest.mark.parametrize('bad, message', [
    ({'grid': {'train.seed': [1, 2]}}, 'seeds'),
    ({'cells': [{'model.norm': 'rmsnorm'}, {'model.norm': 'rmsnorm'}]}, 'both named'),
    ({'cells': [{'model.norm': 'rmsnorm'}], 'grid': {'model.norm': ['layernorm']}}, 'both in'),
    ({'grids': {}}, 'unknown sweep keys'),
    ({'grid': {'model.norm': []}}, 'non-empty'),
])
def test_bad_sweeps_are_rejected(bad, message):
  with pytest.raises(sweep.SweepError, match=message):
    sweep.expand(bad)


@pytest.mark.parametrize('path', ABLATIONS, ids=os.path.basename)
def test_every_ablation_file_expands_into_valid_configs(path):
  module = sweep.load_sweep_module(path)
  for arg in (None, 'quick'):
    cells = sweep.expand(sweep.get_sweep(module, arg))
    assert cells
    for cell in cells:
      config = sweep.cell_config(module, arg, cell)
      assert config.train.seed == cell['seed']
      for field, value in cell['overrides'].items():
        section, name = field.split('.')
        assert config[section][name] == value


def test_postln_vs_preln_has_the_cells_of_the_study():
  module = sweep.load_sweep_module(os.path.join(ROOT, 'configs', 'ablations',
                                                'postln_vs_preln.py'))
  cells = sweep.expand(sweep.get_sweep(module))
  keys = {(c['overrides']['model.num_layers'], c['overrides']['train.learning_rate'],
           c['overrides']['train.steps'], c['overrides']['train.warmup_steps'],
           c['overrides']['model.norm_position']) for c in cells}
  assert keys == {(6, 2e-3, 500, 0, 'post'), (6, 2e-3, 500, 0, 'pre'),
                  (6, 2e-3, 1000, 100, 'post'), (6, 2e-3, 1000, 100, 'pre'),
                  (6, 2e-3, 1000, 0, 'pre'), (12, 1e-3, 500, 0, 'post'),
                  (12, 1e-3, 500, 0, 'pre'), (6, 1e-3, 500, 0, 'post'), (6, 1e-3, 500, 0, 'pre')}
  assert len(cells) == 27  # three seeds
  c = sweep.cell_config(module, None, cells[0])
  assert (c.data.packing, c.train.loss_on, c.model.arch) == ('stream', 'all', 'decoder_only')
  assert (c.model.d_model, c.model.num_heads, c.train.b2, c.train.batch_size) == (64, 4, 0.999, 32)
  assert (c.data.max_length, c.train.schedule, c.train.grad_clip_norm) == (64, 'constant', 0.0)


def test_a_bad_cell_fails_before_anything_runs(tmp_path):
  spec = write_sweep(tmp_path, "{'grid': {'model.norm_position': ['pre', 'middle']}}")
  launched = []
  with pytest.raises(sweep.SweepError, match='model.norm_position'):
    sweep.run_sweep(spec, str(tmp_path / 'sw'), launch=lambda *a: launched.append(a) or 0)
  assert not launched
  spec = write_sweep(tmp_path, "{'grid': {'model.no_such_field': [1]}}")
  with pytest.raises(sweep.SweepError, match='no config field'):
    sweep.run_sweep(spec, str(tmp_path / 'sw'), dry_run=True)


# --- running: dry run, skip, resume --------------------------------------------------------------

def test_dry_run_prints_one_train_command_per_cell_and_the_eval_commands(tmp_path):
  out = io.StringIO()
  spec = os.path.join('configs', 'ablations', 'rope_vs_alibi.py')
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    results = sweep.run_sweep(spec, 'SW', dry_run=True, out=out)
  finally:
    os.chdir(cwd)
  lines = out.getvalue().splitlines()
  train_lines = [l for l in lines if l.startswith('python train.py')]
  assert len(train_lines) == len(results) == 6
  assert train_lines[2] == ('python train.py --config=configs/ablations/rope_vs_alibi.py '
                            '--workdir=SW/model.position=rope,seed=0 '
                            '--config.model.position=rope --config.train.seed=0')
  evals = [l for l in lines if l.startswith('python eval.py --workdir=SW/model.position=rope,')]
  assert len(evals) == 4  # eval_flags, then the three scalings of eval_variants
  assert evals[3].endswith('--lengths=1,2,4,8 --modes=non_overlapping,sliding '
                           '--rope_scaling=yarn:4')
  assert not os.path.exists(os.path.join(ROOT, 'SW'))


def _fake_workdir(path, checkpoint_steps=(), train_losses=()):
  os.makedirs(path / 'checkpoints', exist_ok=True)
  for s in checkpoint_steps:
    os.makedirs(path / 'checkpoints' / str(s))
  with open(path / 'metrics.jsonl', 'w') as f:
    for i, loss in enumerate(train_losses):
      f.write(json.dumps({'step': i + 1, 'split': 'train', 'loss': loss}) + '\n')


@pytest.mark.parametrize('parallel', [1, 2])
def test_finished_cells_are_skipped_interrupted_ones_resumed(tmp_path, parallel):
  spec = write_sweep(tmp_path, "{'grid': {'model.norm': ['layernorm', 'rmsnorm'], "
                               "'model.norm_position': ['pre', 'post']}}")
  sw = tmp_path / 'sw'
  names = [c['name'] for c in sweep.expand(sweep.get_sweep(sweep.load_sweep_module(spec)))]
  done, partial, diverged, new = names
  _fake_workdir(sw / done, [10, 20], [5.0, 4.0])
  _fake_workdir(sw / partial, [10], [5.0])
  _fake_workdir(sw / diverged, [10], [5.0, float('nan')])
  launched = []

  def launch(argv, log_path, env):
    launched.append((argv, env))
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    assert os.path.dirname(log_path) == workdir
    os.makedirs(os.path.join(workdir, 'checkpoints', '20'))  # as train.py finishing would
    return 0

  out = io.StringIO()
  results = sweep.run_sweep(spec, str(sw), parallel=parallel, launch=launch, out=out)
  assert results == {done: 'skipped', partial: 'done', diverged: 'diverged', new: 'done'}
  assert sorted(os.path.basename(a[3].split('=', 1)[1]) for a, _ in launched) == sorted(
      [partial, new])
  argv = next(a for a, _ in launched if partial in a[3])
  assert argv[:3] == [sys.executable, os.path.join(ROOT, 'train.py'), f'--config={spec}']
  assert argv[4:] == ['--config.model.norm=layernorm', '--config.model.norm_position=post',
                      '--config.train.seed=0']
  text = out.getvalue()
  assert f'{partial}: done (resuming from step 10' in text
  assert f'{done}: skipped' in text and f'{new}: done (new' in text
  assert len([l for l in text.splitlines() if l.startswith('[')]) == 4
  threads = [env.get('XLA_FLAGS', '') for _, env in launched]
  assert all(('intra_op_parallelism_threads=1' in t) == (parallel > 1) for t in threads)
  # A second run has nothing left to do.
  launched.clear()
  results = sweep.run_sweep(spec, str(sw), parallel=parallel, launch=launch, out=io.StringIO())
  assert not launched and set(results.values()) == {'skipped', 'diverged'}


def run_tool(module, *args):
  return subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)


def test_cli_dry_run(tmp_path):
  """`python -m tools.sweep` with --dry_run and --seeds prints one train.py command per cell."""
  result = run_tool('tools.sweep', '--sweep=configs/ablations/ffn_norm.py',
                    f'--sweep_dir={tmp_path}/sw', '--dry_run', '--seeds=4,5')
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert len(lines) == 16 and all(l.startswith('python train.py') for l in lines)
  assert lines[0].endswith('--config.model.ffn=relu --config.model.norm=layernorm '
                           '--config.train.seed=4')
  assert not os.path.exists(tmp_path / 'sw')


def test_cli_exit_codes(tmp_path):
  """2 without --sweep_dir or on a sweep file that cannot be expanded; 1 when a cell fails."""
  result = run_tool('tools.sweep', '--sweep=configs/ablations/ffn_norm.py')
  assert result.returncode == 2 and 'required' in result.stderr
  spec = write_sweep(tmp_path, "{'grid': {'model.norm_position': ['pre', 'middle']}}")
  result = run_tool('tools.sweep', f'--sweep={spec}', f'--sweep_dir={tmp_path}/sw')
  assert result.returncode == 2 and 'sweep error: cell ' in result.stderr
  assert not os.path.exists(tmp_path / 'sw')
  # A cell whose train.py exits non-zero (a data_dir under a file: config error) fails the sweep.
  (tmp_path / 'a_file').write_text('')
  spec = write_sweep(tmp_path, "{'grid': {'data.data_dir': [%r]}}" % str(tmp_path / 'a_file/d'))
  result = run_tool('tools.sweep', f'--sweep={spec}', f'--sweep_dir={tmp_path}/sw')
  assert result.returncode == 1, result.stderr
  assert ': failed (rc 2' in result.stdout


def test_attention_sweep_names_every_registered_variant():
  """configs/ imports no layers: the sweep lists the variants as strings, this keeps it complete."""
  from layers import attention_variants  # pylint: disable=g-import-not-at-top
  module = sweep.load_sweep_module(os.path.join(ROOT, 'configs', 'ablations',
                                                'attention_variants.py'))
  cells = sweep.expand(sweep.get_sweep(module))
  assert sorted(c['overrides']['model.attention'] for c in cells) == sorted(attention_variants.VARIANTS)


# --- compare -------------------------------------------------------------------------------------

def write_run(workdir, train, valid=(), *, steps=100, seed=0, fields=None, entropy=None,
              num_params=1000):
  """A synthetic workdir: train/valid [(step, loss)], config.json, run_info.json."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for step, loss in train:
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': loss,
                          'tokens_per_sec': 1000.0 + step}) + '\n')
    for step, loss in valid:
      f.write(json.dumps({'step': step, 'split': 'valid', 'loss': loss}) + '\n')
  config = {'train': {'steps': steps, 'seed': seed}, 'model': dict(fields or {})}
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(config, f)
  info = {'num_params': num_params}
  if entropy is not None:
    info['unigram_entropy'] = entropy
  with open(os.path.join(workdir, 'run_info.json'), 'w') as f:
    json.dump(info, f)


def test_band_is_mean_min_max_across_seeds():
  a = (np.array([10, 20, 30]), np.array([3.0, 2.0, 1.0]))
  b = (np.array([10, 20, 30]), np.array([5.0, 4.0, np.nan]))
  c = (np.array([10, 20]), np.array([4.0, 3.0]))
  steps, mean, lo, hi = compare.band([a, b, c])
  np.testing.assert_array_equal(steps, [10, 20, 30])
  np.testing.assert_allclose(mean, [4.0, 3.0, 1.0])
  np.testing.assert_allclose(lo, [3.0, 2.0, 1.0])
  np.testing.assert_allclose(hi, [5.0, 4.0, 1.0])


def test_divergence_rule():
  steps = np.arange(10, 101, 10)
  smooth = np.linspace(5, 2, 10)
  assert compare.divergence(steps, smooth, 100) is None
  spike = smooth.copy()
  spike[6] = 2.1 * smooth[:6].min()
  assert compare.divergence(steps, spike, 100) == 70
  nan = smooth.copy()
  nan[4] = float('nan')
  assert compare.divergence(steps, nan, 100) == 50
  early = np.array([1.0, 3.0, 1.0, 0.9])  # a spike within the first 10% of the steps is allowed
  assert compare.divergence(np.array([1, 5, 50, 100]), early, 100) is None


def test_plateau_rule():
  steps = np.arange(10, 101, 10)
  stuck = np.array([6.0, 5.0, 3.5, 3.46, 3.45, 3.45, 3.44, 3.43, 3.42, 3.41])  # 25%: step 30
  assert compare.plateaued(steps, stuck, 100, level=3.3)  # 3.41 >= 0.95 * 3.5 and > 0.9 * 3.3
  assert not compare.plateaued(steps, stuck, 100, level=4.0)  # converged below the unigram level
  falling = np.linspace(6, 1, 10)
  assert not compare.plateaued(steps, falling, 100, level=3.3)
  # Without the entropy the level is half the first loss (3.0 here): 3.41 > 0.9 * 3.33.
  assert compare.plateaued(steps, stuck, 100, level=None)


def test_steps_to_target_and_smoothing():
  steps, losses = np.array([10, 20, 30, 40]), np.array([4.0, 3.1, 2.9, 3.0])
  assert compare.steps_to_target(steps, losses, 3.0) == 30
  assert compare.steps_to_target(steps, losses, 1.0) is None
  np.testing.assert_allclose(compare.smooth(np.full(5, 2.0), 'ema:0.9'), 2.0)  # debiased
  np.testing.assert_allclose(compare.smooth(np.array([1.0, 3.0, 5.0, 7.0]), 'ma:2'),
                             [1.0, 2.0, 4.0, 6.0])
  np.testing.assert_allclose(compare.smooth(np.array([0.0, 1.0]), '0.5'), [0.0, 2.0 / 3.0])
  with pytest.raises(ValueError, match='valid forms'):
    compare.smooth(np.ones(2), 'gauss:3')


def test_compare_groups_seeds_flags_and_tabulates(tmp_path):
  steps = list(range(10, 101, 10))
  valid_steps = [50, 100]
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
  assert pre[2] == '2.1000 [2.0000, 2.2000]'  # final validation loss: mean [min, max]
  assert pre[4] == '75 [50, 100] (2/2)'  # steps to valid <= 3.7: 50 (seed 0) and 100 (seed 1)
  assert pre[6] == '1,000' and pre[7] == 'ok |'
  assert 'DIVERGED 1/1 (step 70)' in rows['norm_position=post']
  assert 'PLATEAU 1/1' in rows['norm_position=mid']
  assert 'never (0/1)' in rows['norm_position=mid']


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
  rows = [line for line in table.splitlines() if line.startswith('| ') and '---' not in line][1:]
  assert len(rows) == 1 and rows[0].split(' | ')[1] == '2', table


def test_compare_cli_prints_the_table_and_the_png(tmp_path):
  """`python -m tools.compare DIR ...`: workdirs with commas in their names, the table, `wrote OUT`;
  exit 2 on a missing run or a bad option."""
  for seed in (0, 1):
    write_run(tmp_path / f'sw/model.ffn=relu,seed={seed}', [(10, 3.0), (20, 2.0 + seed)],
              [(20, 2.5)], steps=20, seed=seed, fields={'ffn': 'relu'})
  write_run(tmp_path / 'other', [(10, 3.0), (20, 2.2)], steps=20, fields={'ffn': 'gelu'})
  out = tmp_path / 'cmp.png'
  result = run_tool('tools.compare', str(tmp_path / 'sw/model.ffn=relu,seed=0'),
                    str(tmp_path / 'sw/model.ffn=relu,seed=1'), str(tmp_path / 'other'),
                    f'--out={out}', '--logy', '--smooth=ema:0.5', '--target_loss=2.6')
  assert result.returncode == 0, result.stderr
  assert '| ffn=relu | 2 | 2.5000 [2.5000, 2.5000] |' in result.stdout
  assert '| ffn=gelu | 1 |' in result.stdout
  assert result.stdout.rstrip().endswith(f'wrote {out}') and out.stat().st_size > 10000
  result = run_tool('tools.compare', str(tmp_path / 'sw'))  # a sweep directory: its default PNG
  assert result.returncode == 0 and (tmp_path / 'sw' / 'compare.png').exists(), result.stderr
  for args in ([str(tmp_path / 'nope')], [str(tmp_path / 'sw'), '--smooth=gauss:3'], []):
    result = run_tool('tools.compare', *args)
    assert result.returncode == 2 and result.stderr.strip(), (args, result.stderr)
