"""Sweeps (tools/sweep/__main__.py) and comparisons (tools/compare/comparison.py): expansion, names,
skip/resume, --dry_run, and the comparison's band, divergence, plateau and steps-to-target on
synthetic runs."""

from tests.helpers import ROOT, write_run
import io
import json
import os
import subprocess
import sys

import pytest

from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec


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


def test_a_bad_cell_fails_before_anything_runs(tmp_path):
  spec = write_sweep(tmp_path, "{'grid': {'model.norm_position': ['pre', 'middle']}}")
  launched = []
  with pytest.raises(sweep_spec.SweepError, match='model.norm_position'):
    sweep_runner.run_sweep(spec, str(tmp_path / 'sw'), launch=lambda *a: launched.append(a) or 0)
  assert not launched
  spec = write_sweep(tmp_path, "{'grid': {'model.no_such_field': [1]}}")
  with pytest.raises(sweep_spec.SweepError, match='no config field'):
    sweep_runner.run_sweep(spec, str(tmp_path / 'sw'), dry_run=True)


def test_dry_run_prints_one_train_command_per_cell_and_the_eval_commands(tmp_path):
  out = io.StringIO()
  spec = os.path.join('configs', 'ablations', 'rope_vs_alibi.py')
  cwd = os.getcwd()
  os.chdir(ROOT)
  try:
    results = sweep_runner.run_sweep(spec, 'SW', dry_run=True, out=out)
  finally:
    os.chdir(cwd)
  lines = out.getvalue().splitlines()
  train_lines = [l for l in lines if l.startswith('python train.py')]
  assert len(train_lines) == len(results) == 27  # 9 position methods x 3 seeds
  assert train_lines[3] == ('python train.py --config=configs/ablations/rope_vs_alibi.py '
                            '--workdir=SW/model.position=rope,seed=0 '
                            '--config.model.position=rope --config.train.seed=0')
  evals = [l for l in lines
           if l.startswith('python eval.py --workdir=SW/model.position=rope,seed=0 ')]
  assert len(evals) == 4  # the three scalings of eval_variants, then eval_flags alone
  assert evals[2].endswith('--lengths=1,2,4,8 --modes=non_overlapping,sliding '
                           '--rope_scaling=yarn:4')
  assert evals[3].endswith('--lengths=1,2,4,8 --modes=non_overlapping,sliding')
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
  cells = sweep_spec.expand(sweep_spec.get_sweep(sweep_spec.load_sweep_module(spec)))
  names = [c['name'] for c in cells]
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
  results = sweep_runner.run_sweep(spec, str(sw), parallel=parallel, launch=launch, out=out)
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
  results = sweep_runner.run_sweep(spec, str(sw), parallel=parallel, launch=launch,
                                   out=io.StringIO())
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
  # Final train loss (2.0 and 3.0 at step 20), then final validation loss.
  assert '| ffn=relu | 2 | 2.5000 [2.0000, 3.0000] | 2.5000 [2.5000, 2.5000] |' in result.stdout
  assert '| ffn=gelu | 1 |' in result.stdout
  assert result.stdout.rstrip().endswith(f'wrote {out}') and out.stat().st_size > 10000
  result = run_tool('tools.compare', str(tmp_path / 'sw'))  # a sweep directory: its default PNG
  assert result.returncode == 0 and (tmp_path / 'sw' / 'compare.png').exists(), result.stderr
  for args in ([str(tmp_path / 'nope')], [str(tmp_path / 'sw'), '--smooth=gauss:3'], []):
    result = run_tool('tools.compare', *args)
    assert result.returncode == 2 and result.stderr.strip(), (args, result.stderr)


TUNED_SWEEP = '''
from configs import decoder_only


def get_config(arg=None):
  config = decoder_only.get_config('quick')
  config.data.data_dir = {DATA!r}
  config.train.update(steps=4, warmup_steps=0, log_every=2, eval_every=4, checkpoint_every=4)
  return config


def get_sweep():
  return {'grid': {'model.norm_position': ['pre', 'post']}, 'seeds': [0, 1]}
'''


def test_a_tuned_sweep_trains_the_second_seed_at_the_chosen_rate_only(tmp_path, data_dir,
                                                                     monkeypatch):
  """tools.sweep --tune on 2 cells x 2 rates x 2 seeds, side by side: four tuning runs, the choice
  file, seed 1 at each cell's chosen rate alone; tools.compare's chosen column and tuning table; a
  rerun launches nothing."""
  from tools.compare import comparison as compare
  # The cells compile through a cache of this test: a seed-1 run finds what its cell's tuning run
  # at that rate compiled (about a third off its time), the second rate the eval step and init.
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', str(tmp_path / 'jax_cache'))
  monkeypatch.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')
  spec = tmp_path / 'tuned.py'
  spec.write_text(TUNED_SWEEP.replace('{DATA!r}', repr(str(data_dir))))
  sw = tmp_path / 'sw'
  tune = '--tune=train.learning_rate:1e-3,3e-2'
  result = run_tool('tools.sweep', f'--sweep={spec}', f'--sweep_dir={sw}', tune, '--parallel=2')
  assert result.returncode == 0, result.stdout + result.stderr
  doc = json.loads((sw / 'tune.json').read_text())
  assert doc['field'] == 'train.learning_rate' and doc['values'] == [0.001, 0.03]
  workdirs = sorted(p.name for p in sw.iterdir() if p.is_dir())
  assert len(workdirs) == 6, workdirs
  for entry in doc['cells']:
    losses = [t['valid_loss'] for t in entry['tuning']]
    for t in entry['tuning']:  # every rate at seed 0, its final evaluation recorded
      rows = [json.loads(l) for l in (sw / t['run'] / 'metrics.jsonl').read_text().splitlines()]
      assert t['status'] == 'done' and t['valid_loss'] == [
          r['loss'] for r in rows if r['split'] == 'valid'][-1]
    assert entry['chosen'] == doc['values'][losses.index(min(losses))]
    seed_1 = [w for w in workdirs if w.startswith(entry['cell'] + ',') and w.endswith('seed=1')]
    assert seed_1 == [entry['runs'][1]] and f'learning_rate={entry["chosen"]!r},' in seed_1[0]
    config = json.loads((sw / seed_1[0] / 'config.json').read_text())
    assert config['train']['learning_rate'] == entry['chosen']
    assert f'tune: {entry["cell"]}: train.learning_rate={entry["chosen"]!r};' in result.stdout
  text = compare.compare([str(sw)], str(tmp_path / 'cmp.png'))
  assert ('| cell | seeds | chosen learning_rate |' in text
          and '| cell | 0.001 | 0.03 | chosen |' in text)
  for entry in doc['cells']:
    short = entry['cell'].replace('model.', '')
    assert f'| {short} | 2 | {entry["chosen"]!r} |' in text, text
    tuning_row = next(l for l in text.splitlines() if l.startswith(f'| {short} | ') and '**' in l)
    assert tuning_row.endswith(f' | {entry["chosen"]!r} |')
  launched = []
  again = sweep_runner.run_sweep(str(spec), str(sw), tune=tune.split('=', 1)[1], parallel=2,
                                 launch=lambda *a: launched.append(a) or 1, out=io.StringIO())
  assert not launched and set(again.values()) == {'skipped'} and len(again) == 6
