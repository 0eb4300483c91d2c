"""tools.sweep: a cell started from another cell's parameters (train.init_from={'cell': {...}}) gets
that cell's workdir and runs only after it, also side by side (--parallel); the evaluations of
finished cells, and a rerun that runs those a stopped sweep left undone."""

import io
import os
import threading
import time

import pytest

from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec

SWEEP = '''
from configs import extrapolation

def get_config(arg=None):
  return extrapolation.get_config('quick')

def get_sweep():
  base = {'data.max_length': 64}
  return {'cells': [base] + [{'train.init_from': {'cell': base}, 'data.max_length': 128,
                              'model.rope_scaling': s, 'model.rope_scaling_factor': 2.0}
                             for s in ('pi', 'yarn')],
          'seeds': [0, 1]}
'''


def _write(tmp_path, text=SWEEP):
  path = tmp_path / 'deps.py'
  path.write_text(text)
  return str(path)


def test_a_fine_tune_names_its_source_cell_and_gets_its_workdir(tmp_path):
  cells = sweep_spec.expand(sweep_spec.get_sweep(sweep_spec.load_sweep_module(_write(tmp_path))))
  names = [c['name'] for c in cells]
  assert names[:2] == ['data.max_length=64,seed=0', 'data.max_length=64,seed=1']
  tunes = cells[2:]
  assert [c['after'] for c in tunes] == ['data.max_length=64,seed=0',
                                         'data.max_length=64,seed=1'] * 2
  assert all(c['after'] is None for c in cells[:2])
  # In the name the source appears once, without its seed (it is the fine-tune's own).
  assert tunes[0]['overrides']['train.init_from'] == 'data.max_length=64'
  assert tunes[0]['name'] == ('data.max_length=128,model.rope_scaling=pi,model.rope_scaling_factor='
                              '2.0,train.init_from=data.max_length=64,seed=0')
  argv = sweep_spec.train_command('x.py', '/sw', tunes[0])
  assert f'--config.train.init_from=/sw/{tunes[0]["after"]}' in argv
  assert '--config.train.seed=0' in argv


@pytest.mark.parametrize('text,match', [
    # The source listed after its fine-tune: it could not have run first.
    (SWEEP.replace("[base] + [", "[").replace("for s in ('pi', 'yarn')]",
                                              "for s in ('pi',)] + [base]"),
     'overrides of a cell listed before this one'),
    ("def get_config(arg=None):\n  from configs import extrapolation\n"
     "  return extrapolation.get_config('quick')\n"
     "def get_sweep():\n  return {'cells': [{'model.rope_scaling': {'cell': {}}}]}\n",
     'valid dict values: train.init_from'),
])
def test_bad_sources_are_refused(tmp_path, text, match):
  with pytest.raises(sweep_spec.SweepError, match=match):
    sweep_spec.expand(sweep_spec.get_sweep(sweep_spec.load_sweep_module(_write(tmp_path, text))))


@pytest.mark.parametrize('fail_base', [False, True])
def test_fine_tunes_start_only_after_their_source_also_in_parallel(tmp_path, fail_base):
  spec = _write(tmp_path)
  events, lock = [], threading.Lock()

  def launch(argv, log_path, env):
    del log_path, env
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    name = os.path.basename(workdir)
    with lock:
      events.append(('start', name))
    time.sleep(0.3 if 'max_length=64' in name else 0.05)  # the base is the slow one
    with lock:
      events.append(('end', name))
    if fail_base and 'max_length=64' in name:
      return 1
    os.makedirs(os.path.join(workdir, 'checkpoints', '20'))  # as train.py finishing would
    return 0

  results = sweep_runner.run_sweep(spec, str(tmp_path / 'sw'), parallel=2, launch=launch,
                                   out=io.StringIO())
  for seed in (0, 1):
    base = f'data.max_length=64,seed={seed}'
    tunes = [n for n in results if n.endswith(f'seed={seed}') and n != base]
    assert len(tunes) == 2
    if fail_base:
      assert results[base] == 'failed (rc 1)'
      assert all(results[t] == 'not started' for t in tunes)
      assert all(('start', t) not in events for t in tunes)
    else:
      assert set(results.values()) == {'done'}
      for t in tunes:  # each fine-tune started after its own base ended
        assert events.index(('start', t)) > events.index(('end', base))


def test_eval_json_is_the_plain_evaluation_and_each_variant_keeps_its_own(tmp_path):
  """eval.py always writes eval.json: the variants run first and are renamed, the plain
  evaluation (eval_flags alone) last, so that eval.json is its own and none is lost."""
  spec = _write(tmp_path, SWEEP.replace(
      "'seeds': [0, 1]}",
      "'seeds': [0], 'eval_flags': ['--lengths=1,2'],\n"
      "          'eval_variants': {'data.max_length=64': ['--rope_scaling=pi:2', "
      "'--rope_scaling=ntk:2']}}"))

  def launch(argv, log_path, env):
    del log_path, env
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    if argv[1].endswith('eval.py'):
      with open(os.path.join(workdir, 'eval.json'), 'w') as f:
        f.write(' '.join(argv[3:]))  # the flags after --workdir
    else:
      os.makedirs(os.path.join(workdir, 'checkpoints', '20'))
    return 0

  sweep_runner.run_sweep(spec, str(tmp_path / 'sw'), run_eval=True, launch=launch,
                         out=io.StringIO())
  base = tmp_path / 'sw' / 'data.max_length=64,seed=0'
  assert (base / 'eval.json').read_text() == '--lengths=1,2'
  assert (base / 'eval_rope_scaling=pi_2.json').read_text() == '--lengths=1,2 --rope_scaling=pi:2'
  assert (base / 'eval_rope_scaling=ntk_2.json').read_text() == '--lengths=1,2 --rope_scaling=ntk:2'
  tune = next(p for p in (tmp_path / 'sw').iterdir() if 'rope_scaling=pi' in p.name)
  assert (tune / 'eval.json').read_text() == '--lengths=1,2'
  assert not list(tune.glob('eval_*.json'))


def test_a_rerun_runs_only_the_evaluations_a_stopped_sweep_left_undone(tmp_path):
  """A sweep stopped after a cell trained, and after a variant's eval.py wrote eval.json but before
  its rename, runs that variant and the plain evaluation again, and trains nothing."""
  spec = _write(tmp_path, SWEEP.replace(
      "'seeds': [0, 1]}",
      "'seeds': [0], 'eval_flags': ['--lengths=1,2'],\n"
      "          'eval_variants': {'data.max_length=64': ['--rope_scaling=pi:2', "
      "'--rope_scaling=ntk:2']}}"))
  launched = []

  def launch(argv, log_path, env):
    del log_path, env
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    launched.append((os.path.basename(workdir), ' '.join(argv[3:])))
    if argv[1].endswith('eval.py'):
      with open(os.path.join(workdir, 'eval.json'), 'w') as f:
        f.write(' '.join(argv[3:]))
    else:
      os.makedirs(os.path.join(workdir, 'checkpoints', '20'))
    return 0

  sweep_dir = tmp_path / 'sw'
  sweep_runner.run_sweep(spec, str(sweep_dir), run_eval=True, launch=launch, out=io.StringIO())
  base = sweep_dir / 'data.max_length=64,seed=0'
  (base / 'eval_rope_scaling=ntk_2.json').rename(base / 'eval.json')  # the stop's leftovers
  launched.clear()
  out = io.StringIO()
  sweep_runner.run_sweep(spec, str(sweep_dir), run_eval=True, launch=launch, out=out)
  assert launched == [('data.max_length=64,seed=0', '--lengths=1,2 --rope_scaling=ntk:2'),
                      ('data.max_length=64,seed=0', '--lengths=1,2')]
  assert 'evaluations resumed' in out.getvalue()
  assert (base / 'eval.json').read_text() == '--lengths=1,2'
  assert (base / 'eval_rope_scaling=ntk_2.json').read_text() == (
      '--lengths=1,2 --rope_scaling=ntk:2')
  launched.clear()
  sweep_runner.run_sweep(spec, str(sweep_dir), run_eval=True, launch=launch, out=io.StringIO())
  assert not launched  # nothing is left to do
