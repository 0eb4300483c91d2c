"""tools.sweep --tune (tools/sweep/tune.py): the flag's checks, the selection rule on fake workdirs,
the seed plan, the runner's order and choice file with a fake train.py, and tools.compare's chosen
column and tuning table (tools/compare/tune_table.py) on synthetic runs."""

from tests.helpers import write_run
import io
import json
import math
import os
import re
import threading
import time

import pytest

from tools.compare import comparison as compare
from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec
from tools.sweep import tune as sweep_tune

SWEEP = '''
from configs import decoder_only


def get_config(arg=None):
  return decoder_only.get_config('quick')


def get_sweep():
  return {'grid': {'model.norm_position': ['pre', 'post']}, 'seeds': [0, 1, 2]}
'''
LR = 'train.learning_rate'


def _module(tmp_path, text=SWEEP):
  path = tmp_path / 'tune_sweep.py'
  path.write_text(text)
  return str(path), sweep_spec.load_sweep_module(str(path))


def _parse(tmp_path, tune, text=SWEEP):
  _, module = _module(tmp_path, text)
  return sweep_tune.parse(tune, module, None, sweep_spec.get_sweep(module))


# --- The flag -------------------------------------------------------------------------------------

def test_values_take_the_type_of_the_field(tmp_path):
  assert _parse(tmp_path, 'train.learning_rate:5e-4,1e-3, 2') == (LR, [0.0005, 0.001, 2.0],
                                                                  sweep_tune.TOLERANCE)
  assert _parse(tmp_path, 'train.warmup_steps:0,10')[:2] == ('train.warmup_steps', [0, 10])
  assert _parse(tmp_path, 'model.use_bias:True,false')[:2] == ('model.use_bias', [True, False])
  assert _parse(tmp_path, 'model.ffn:relu,gelu')[:2] == ('model.ffn', ['relu', 'gelu'])


@pytest.mark.parametrize('tune, message', [
    ('train.no_such_field:1,2', "no config field 'train.no_such_field'"),
    ('train.learning_rate:', 'no values to try'),
    ('train.learning_rate', 'no values to try'),
    ('train.learning_rate:1e-3,,2e-3', 'an empty value'),
    (':1e-3', 'no config field;'),
    ('model.norm_position:pre,post', 'already sets model.norm_position (in its grid)'),
    ('train.seed:1,2', 'set with --seeds'),
    ('train.learning_rate:fast', "'fast' is not a number"),
    ('train.warmup_steps:1.5', "'1.5' is not an integer"),
    ('train.learning_rate:1e-3,0.001', 'listed twice'),
    ('train:1,2', 'is a section'),
])
def test_bad_tune_flags_are_one_line(tmp_path, tune, message):
  with pytest.raises(sweep_spec.SweepError, match=re.escape(message)) as e:
    _parse(tmp_path, tune)
  assert '\n' not in str(e.value) and str(e.value).startswith(f'--tune={tune}:')


def test_a_field_set_by_the_sweeps_cells_is_refused(tmp_path):
  text = SWEEP.replace("'grid': {'model.norm_position': ['pre', 'post']}",
                       "'cells': [{'train.learning_rate': 1e-3}, {'model.ffn': 'gelu'}]")
  with pytest.raises(sweep_spec.SweepError, match=r'already sets train.learning_rate \(in its '
                     r'cells\)'):
    _parse(tmp_path, 'train.learning_rate:1e-3,2e-3', text)


# --- The rule -------------------------------------------------------------------------------------

def test_the_lowest_final_validation_loss_of_a_finished_run_wins():
  done = lambda loss: {'status': 'done', 'valid_loss': loss}
  assert sweep_tune.choose([done(2.3), done(2.1), done(2.2)]) == 1
  assert sweep_tune.choose([done(2.1), done(2.1)]) == 0  # a tie: the value listed first
  # Diverged, unfinished or without a finite loss: never chosen, however low its last loss.
  assert sweep_tune.choose([{'status': 'diverged', 'valid_loss': 1.0}, done(2.5),
                            {'status': 'partial', 'valid_loss': 1.5}, done(float('nan')),
                            done(None)]) == 1
  assert sweep_tune.choose([{'status': 'diverged', 'valid_loss': 1.0}]) is None


def _fake_workdir(path, steps, valid, train_last=3.0):
  """A workdir as train.py leaves it: checkpoints/<steps> when it finished, metrics.jsonl with
  validation losses [(step, loss)] and a last training loss."""
  os.makedirs(path / 'checkpoints', exist_ok=True)
  if steps:
    os.makedirs(path / 'checkpoints' / str(steps), exist_ok=True)
  rows = [{'step': s, 'split': 'valid', 'loss': v} for s, v in valid]
  rows.append({'step': valid[-1][0] if valid else 1, 'split': 'train', 'loss': train_last})
  (path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))


def test_a_cell_decides_from_its_workdirs_final_evaluation(tmp_path):
  """The final evaluation, not the best: 0.002 dips lowest at step 10 but ends higher."""
  axis = sweep_tune.Axis(LR, [0.001, 0.002, 0.004])
  tuning = sweep_tune.CellTuning(axis, {'model.norm_position': 'post'}, [0, 1])
  a, b, c = tuning.runs
  _fake_workdir(tmp_path / a, 20, [(10, 3.0), (20, 2.5)])
  _fake_workdir(tmp_path / b, 20, [(10, 2.0), (20, 2.6)])
  _fake_workdir(tmp_path / c, None, [(10, 1.0)], train_last=float('nan'))  # diverged
  steps = dict.fromkeys(tuning.runs, 20)
  tuning.decide({a: 'done', b: 'skipped', c: 'diverged'}, str(tmp_path), steps)
  assert tuning.chosen == 0.001 and tuning.note == ''
  assert [r['status'] for r in tuning.records] == ['done', 'done', 'diverged']
  assert 'norm_position=post: train.learning_rate=0.001 (the smallest value of the grid: one ' \
         'beyond it may do better); final valid loss 0.001: 2.5000, 0.002: 2.6000, ' \
         '0.004: diverged' in tuning.summary()
  # A tuning run that failed: nothing is chosen, and the other seeds cannot run.
  again = sweep_tune.CellTuning(axis, {'model.norm_position': 'post'}, [0, 1])
  again.decide({a: 'done', b: 'failed (rc 1)', c: 'diverged'}, str(tmp_path), steps)
  assert again.chosen is None and again.note == f'tuning run {b}: failed (rc 1)'
  seed_1 = again.seed_cells()[0]
  assert again.resolve(seed_1) == (seed_1, f'no {LR} chosen: tuning run {b}: failed (rc 1)')


def test_on_a_flat_signal_the_smallest_value_within_the_tolerance_is_chosen(tmp_path):
  done = lambda loss: {'status': 'done', 'valid_loss': loss}
  records = [done(1.2040), done(1.2030), done(1.2015), {'status': 'diverged', 'valid_loss': 1.0}]
  values = [5e-4, 1e-3, 2e-3, 4e-3]
  assert sweep_tune.choose(records, values, 0.0) == 2  # the plain lowest
  assert sweep_tune.choose(records, values, 0.003) == 0  # 1.2040 is within 0.003 of 1.2015
  assert sweep_tune.choose(records, values, 0.002) == 1
  assert sweep_tune.choose(records[::-1], values[::-1], 0.003) == 3  # the smallest, not the first
  assert sweep_tune.choose(records, ['a', 'b', 'c', 'd'], 0.003) == 0  # not numbers: first listed
  # A clear gap is no flat signal: the best stands.
  assert sweep_tune.choose([done(1.30), done(1.20)], [5e-4, 1e-3], 0.003) == 1
  with pytest.raises(sweep_spec.SweepError, match='--tune_tolerance=-1 must be a number >= 0'):
    _, module = _module(tmp_path, SWEEP)
    sweep_tune.parse(f'{LR}:1e-3', module, None, sweep_spec.get_sweep(module), -1)


def test_a_choice_at_the_grids_edge_is_flagged():
  assert sweep_tune.grid_edge([5e-4, 1e-3, 2e-3], 2e-3) == 'the largest'
  assert sweep_tune.grid_edge([2e-3, 1e-3, 5e-4], 2e-3) == 'the largest'  # any order
  assert sweep_tune.grid_edge([5e-4, 1e-3, 2e-3], 5e-4) == 'the smallest'
  assert sweep_tune.grid_edge([5e-4, 1e-3, 2e-3], 1e-3) is None
  assert sweep_tune.grid_edge([1e-3, 2e-3], 2e-3) is None  # two values have no inside
  assert sweep_tune.grid_edge(['relu', 'gelu', 'swiglu'], 'relu') is None  # no order
  assert sweep_tune.grid_edge([5e-4, 1e-3, 2e-3], None) is None
  axis = sweep_tune.Axis(LR, [0.001, 0.002, 0.004])
  tuning = sweep_tune.CellTuning(axis, {'model.norm_position': 'pre'}, [0, 1])
  tuning.chosen = 0.004
  assert 'train.learning_rate=0.004 (the largest value of the grid: one beyond it may do better)' \
      in tuning.summary()


# --- The plan -------------------------------------------------------------------------------------

def test_each_cell_tunes_at_the_first_seed_then_runs_its_other_seeds_at_the_choice(tmp_path):
  cells = sweep_spec.expand({'grid': {'model.norm_position': ['pre', 'post']}, 'seeds': [3, 4]})
  plan, tunings = sweep_tune.plan(cells, sweep_tune.Axis(LR, [0.001, 0.002]))
  assert [c['name'] for c in plan] == [
      'model.norm_position=pre,train.learning_rate=0.001,seed=3',
      'model.norm_position=pre,train.learning_rate=0.002,seed=3',
      'model.norm_position=pre,train.learning_rate=tuned,seed=4',
      'model.norm_position=post,train.learning_rate=0.001,seed=3',
      'model.norm_position=post,train.learning_rate=0.002,seed=3',
      'model.norm_position=post,train.learning_rate=tuned,seed=4']
  assert plan[1]['overrides'] == {'model.norm_position': 'pre', LR: 0.002}
  assert plan[2]['tuning'] is tunings[0] and plan[2]['overrides'] == {'model.norm_position': 'pre'}
  tunings[0].chosen, tunings[0].decided = 0.002, True
  cell, why = tunings[0].resolve(plan[2])
  assert why is None and cell['name'] == 'model.norm_position=pre,train.learning_rate=0.002,seed=4'
  assert sweep_spec.train_command('s.py', '/sw', cell)[4:] == [
      '--config.model.norm_position=pre', '--config.train.learning_rate=0.002',
      '--config.train.seed=4']
  assert tunings[0].chosen_runs() == [
      'model.norm_position=pre,train.learning_rate=0.002,seed=3', cell['name']]
  with pytest.raises(sweep_spec.SweepError, match='train.init_from'):
    sweep_tune.plan([{**cells[0], 'after': 'x'}], sweep_tune.Axis(LR, [0.001]))


def test_the_choice_file_keeps_an_earlier_choice_until_its_cell_chooses_again(tmp_path):
  """A rerun stopped before a cell's tuning runs were reported leaves that cell's entry as it was;
  one of another axis starts over."""
  cells = sweep_spec.expand({'grid': {'model.norm_position': ['pre', 'post']}})
  axis = sweep_tune.Axis(LR, [0.001, 0.002])
  _, tunings = sweep_tune.plan(cells, axis)
  tunings[0].chosen, tunings[0].decided = 0.002, True
  sweep_tune.ChoiceFile(str(tmp_path), axis, tunings).write()
  _, fresh = sweep_tune.plan(cells, axis)
  sweep_tune.ChoiceFile(str(tmp_path), axis, fresh).write()
  doc = sweep_tune.read_choices(str(tmp_path))
  assert [e['chosen'] for e in doc['cells']] == [0.002, None] and doc['rule'] == sweep_tune.RULE
  other = sweep_tune.Axis(LR, [0.001, 0.004])
  sweep_tune.ChoiceFile(str(tmp_path), other, sweep_tune.plan(cells, other)[1]).write()
  assert [e['chosen'] for e in sweep_tune.read_choices(str(tmp_path))['cells']] == [None, None]


# --- The runner, with a fake train.py -------------------------------------------------------------

def _fake_train(events, lock, fail=None):
  """A launch that logs start/end and ends like train.py: validation loss |lr - best| + 2 where
  the best rate is 0.002 for Pre-LN and 0.001 for Post-LN; tuning runs are the slow ones, the
  higher rate's slowest."""

  def launch(argv, log_path, env):
    del log_path, env
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    name = os.path.basename(workdir)
    with lock:
      events.append(('start', name))
    time.sleep((0.3 if '0.002,seed=0' in name else 0.1) if name.endswith('seed=0') else 0.02)
    with lock:
      events.append(('end', name))
    if fail and fail in name:
      return 1
    lr = float(next(a for a in argv if a.startswith(f'--config.{LR}=')).split('=', 1)[1])
    best = 0.002 if 'norm_position=pre' in name else 0.001
    os.makedirs(os.path.join(workdir, 'checkpoints', '20'))
    with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
      f.write(json.dumps({'step': 20, 'split': 'train', 'loss': 3.0}) + '\n')
      f.write(json.dumps({'step': 20, 'split': 'valid', 'loss': 2 + 100 * abs(lr - best)}) + '\n')
    return 0

  return launch


@pytest.mark.parametrize('parallel', [1, 2])
def test_other_seeds_start_after_their_own_tuning_runs_at_the_chosen_rate(tmp_path, parallel):
  spec, _ = _module(tmp_path)
  sw = tmp_path / 'sw'
  events, lock = [], threading.Lock()
  out = io.StringIO()
  results = sweep_runner.run_sweep(spec, str(sw), parallel=parallel, tune=f'{LR}:1e-3,2e-3',
                                   launch=_fake_train(events, lock), out=out)
  assert len(results) == 8 and set(results.values()) == {'done'}
  started = [name for what, name in events if what == 'start']
  assert {n for n in started if not n.endswith('seed=0')} == {
      f'model.norm_position=pre,{LR}=0.002,seed={s}' for s in (1, 2)} | {
      f'model.norm_position=post,{LR}=0.001,seed={s}' for s in (1, 2)}
  for name in started:  # each other seed starts after its own cell's tuning runs ended
    if not name.endswith('seed=0'):
      cell = name.split(f',{LR}')[0]
      tuning_ends = [i for i, (what, n) in enumerate(events)
                     if what == 'end' and n.startswith(cell + ',') and n.endswith('seed=0')]
      assert len(tuning_ends) == 2 and events.index(('start', name)) > max(tuning_ends)
  if parallel == 2:  # while Pre-LN's second tuning run trains, Post-LN's first takes the free slot
    assert started.index(f'model.norm_position=post,{LR}=0.001,seed=0') < started.index(
        f'model.norm_position=pre,{LR}=0.002,seed=1')
  doc = json.loads((sw / 'tune.json').read_text())
  assert (doc['field'], doc['values'], doc['tuning_seed'], doc['seeds']) == (
      LR, [0.001, 0.002], 0, [0, 1, 2])
  pre, post = doc['cells']
  assert (pre['cell'], pre['chosen'], post['chosen']) == ('model.norm_position=pre', 0.002, 0.001)
  assert [t['valid_loss'] for t in pre['tuning']] == pytest.approx([2.1, 2.0])
  assert pre['runs'] == [f'model.norm_position=pre,{LR}=0.002,seed={s}' for s in (0, 1, 2)]
  assert 'tune: model.norm_position=post: train.learning_rate=0.001;' in out.getvalue()
  # A rerun launches nothing and chooses the same again.
  events.clear()
  again = sweep_runner.run_sweep(spec, str(sw), parallel=parallel, tune=f'{LR}:1e-3,2e-3',
                                 launch=_fake_train(events, lock), out=io.StringIO())
  assert not events and set(again) == set(results) and set(again.values()) == {'skipped'}
  assert json.loads((sw / 'tune.json').read_text()) == doc


def test_a_failed_tuning_run_keeps_its_cells_other_seeds_from_starting(tmp_path):
  spec, _ = _module(tmp_path)
  events, lock = [], threading.Lock()
  results = sweep_runner.run_sweep(spec, str(tmp_path / 'sw'), parallel=2, tune=f'{LR}:1e-3,2e-3',
                                   launch=_fake_train(events, lock, fail='post,train.learning_'
                                                      'rate=0.002,seed=0'), out=io.StringIO())
  post = {n: r for n, r in results.items() if 'norm_position=post' in n}
  assert sorted(post.values()) == ['done', 'failed (rc 1)', 'not started', 'not started']
  assert not any(what == 'start' and 'post' in n and not n.endswith('seed=0') for what, n in events)
  assert all(r == 'done' for n, r in results.items() if 'norm_position=pre' in n)
  entry = json.loads((tmp_path / 'sw' / 'tune.json').read_text())['cells'][1]
  assert entry['chosen'] is None and entry['runs'] == [] and 'failed (rc 1)' in entry['note']


def test_dry_run_prints_the_other_seeds_once_the_tuning_runs_have_ended(tmp_path):
  spec, _ = _module(tmp_path)
  sw = str(tmp_path / 'sw')
  out = io.StringIO()
  sweep_runner.run_sweep(spec, sw, dry_run=True, tune=f'{LR}:1e-3,2e-3', out=out)
  lines = out.getvalue().splitlines()
  assert len(lines) == 8 and sum(l.startswith('# ') for l in lines) == 4
  assert lines[2] == (f'# model.norm_position=pre,{LR}=tuned,seed=1: waits for its tuning runs, '
                      f'then trains at the {LR} they choose')
  assert not os.path.exists(sw)
  for lr, loss in ((0.001, 2.3), (0.002, 2.2)):
    _fake_workdir(tmp_path / 'sw' / f'model.norm_position=pre,{LR}={lr},seed=0', 20,
                  [(20, loss)])
  out = io.StringIO()
  sweep_runner.run_sweep(spec, sw, dry_run=True, tune=f'{LR}:1e-3,2e-3', out=out)
  lines = out.getvalue().splitlines()
  assert lines[2].endswith(f'--config.{LR}=0.002 --config.train.seed=1')
  assert lines[3].endswith(f'--config.{LR}=0.002 --config.train.seed=2')
  assert lines[6][0] == '#'  # Post-LN has not tuned yet


# --- tools.compare --------------------------------------------------------------------------------

def _tuned_sweep(tmp_path):
  """A tuned sweep directory: pre and post, each tuned at 0.001 and 0.002 with seed 0 (post
  diverged at 0.002), then seed 1 at the chosen rate."""
  sw = tmp_path / 'sw'
  losses = {('pre', 0.001): 2.3, ('pre', 0.002): 2.1, ('post', 0.001): 2.2,
            ('post', 0.002): math.nan}
  chosen = {'pre': 0.002, 'post': 0.001}
  cells = []
  for norm in ('pre', 'post'):
    tuning = []
    for lr in (0.001, 0.002):
      name = f'model.norm_position={norm},{LR}={lr},seed=0'
      loss = losses[norm, lr]
      write_run(sw / name, [(50, 4.0), (100, 3.0 if loss == loss else loss)],
                [(100, loss)] if loss == loss else [], fields={'norm_position': norm})
      _set_lr(sw / name, lr)
      tuning.append({'value': lr, 'run': name, 'status': 'done' if loss == loss else 'diverged',
                     'valid_loss': loss if loss == loss else None})
    runs = [f'model.norm_position={norm},{LR}={chosen[norm]},seed={s}' for s in (0, 1)]
    write_run(sw / runs[1], [(50, 4.0), (100, 3.0)], [(100, losses[norm, chosen[norm]] + 0.1)],
              seed=1, fields={'norm_position': norm})
    _set_lr(sw / runs[1], chosen[norm])
    cells.append({'cell': f'model.norm_position={norm}', 'overrides': {}, 'tuning': tuning,
                  'chosen': chosen[norm], 'runs': runs, 'note': ''})
  (sw / 'tune.json').write_text(json.dumps({'field': LR, 'values': [0.001, 0.002],
                                            'tuning_seed': 0, 'seeds': [0, 1], 'cells': cells}))
  return sw


def test_compare_shows_each_cell_at_its_chosen_rate_and_the_tuning_table(tmp_path):
  sw = _tuned_sweep(tmp_path)
  text = compare.compare([str(sw)], str(tmp_path / 'cmp.png'))
  lines = text.splitlines()
  assert lines[0].startswith('| cell | seeds | chosen learning_rate | final train |')
  rows = {l.split(' | ')[0][2:]: l for l in lines[2:4]}
  # The seeds at the chosen rate only: 2.1 (seed 0, the tuning run) and 2.2 (seed 1).
  assert rows['norm_position=pre'].startswith(
      '| norm_position=pre | 2 | 0.002 | 3.0000 [3.0000, 3.0000] | 2.1500 [2.1000, 2.2000] |')
  assert rows['norm_position=post'].startswith('| norm_position=post | 2 | 0.001 |')
  assert len([l for l in lines if l.startswith('| norm_position=')]) == 4  # 2 rows, 2 tables
  table = lines[lines.index('| cell | 0.001 | 0.002 | chosen |'):]
  assert table[2:4] == ['| norm_position=pre | 2.3000 | **2.1000** | 0.002 |',
                        '| norm_position=post | **2.2000** | diverged | 0.001 |']
  assert 'Tuning of train.learning_rate' in text
  assert 'Extrapolation of the same tuning runs' not in text  # no eval.json


def test_compare_tabulates_the_tuning_runs_extrapolation_at_every_rate(tmp_path):
  sw = _tuned_sweep(tmp_path)
  # Pre-LN's tuning runs evaluated at 1, 2, 4, 8 x L: losses 1, 1.1, 1.2, 1.6 at 0.001 and
  # 1, 1.2, 1.5, 2.0 at 0.002 (the chosen rate); post's have no eval.json.
  for lr, losses in ((0.001, (1.0, 1.1, 1.2, 1.6)), (0.002, (1.0, 1.2, 1.5, 2.0))):
    rows = [{'multiple': float(k), 'length': 8 * k, 'mode': 'non_overlapping', 'loss': loss,
             'target_loss': loss} for k, loss in zip((1, 2, 4, 8), losses)]
    workdir = sw / f'model.norm_position=pre,{LR}={lr},seed=0'
    (workdir / 'eval.json').write_text(json.dumps({'extrapolation': rows}))
  lines = compare.compare([str(sw)], str(tmp_path / 'cmp.png')).splitlines()
  head = next(i for i, l in enumerate(lines) if l.startswith('Extrapolation of the same tuning'))
  assert 'r2 / r4 / r8' in lines[head]
  assert lines[head + 2:head + 6] == ['| cell | 0.001 | 0.002 |', '|---|---|---|',
                                      '| norm_position=pre | 1.10 / 1.20 / 1.60 | '
                                      '**1.20 / 1.50 / 2.00** |',
                                      '| norm_position=post | - | - |']


def _set_lr(workdir, lr):
  config = json.loads((workdir / 'config.json').read_text())
  config['train']['learning_rate'] = lr
  (workdir / 'config.json').write_text(json.dumps(config))
