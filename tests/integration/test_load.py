"""Under load: sweeps side by side (each cell its own workdir and lock, a second runner in the same
folder refused in one line), and two processes preparing one dataset at once (prepared once)."""

import json
import os
import subprocess
import sys
import threading

import pytest

from tests.helpers import ROOT
from tools.sweep import runner as sweep_runner

CONFIG = '''
from configs import decoder_only


def get_config(arg=None):
  config = decoder_only.get_config('quick')
  config.train.update(steps=4, warmup_steps=0)
  return config
'''
SWEEP = CONFIG + '''

def get_sweep():
  return {'seeds': list(range(CELLS))}
'''

# A cell's train.py as far as the runner can tell: it takes the workdir's lock (flock, as
# training.lock does; exit 2 if another process holds it), logs a row, and leaves the final
# checkpoint. A real train.py start costs seconds of CPU here; this costs a Python start.
STAND_IN = '''
import fcntl, json, os, sys, time
workdir = sys.argv[1]
with open(os.path.join(workdir, 'lock'), 'a+') as f:
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    sys.exit(2)
  time.sleep(0.02)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'a') as m:
    m.write(json.dumps({'step': 4, 'split': 'train', 'loss': 1.0, 'pid': os.getpid()}) + '\\n')
  os.makedirs(os.path.join(workdir, 'checkpoints', '4'))
'''


def write_sweep(path, cells):
  path.write_text(SWEEP.replace('CELLS', str(cells)))
  return str(path)


def stand_in_launch(launched):
  def launch(argv, log_path, env):
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    launched.append((workdir, next(a for a in argv if a.startswith('--config=')), env))
    with open(log_path, 'a') as log:
      return subprocess.run([sys.executable, '-c', STAND_IN, workdir], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT).returncode
  return launch


def test_fifty_cells_beside_a_second_sweep_all_finish_in_their_own_workdirs(tmp_path):
  spec = write_sweep(tmp_path / 'fifty.py', 50)
  other = write_sweep(tmp_path / 'ten.py', 10)
  launched = {'a': [], 'b': []}
  results = {}

  def sweep(name, path):
    results[name] = sweep_runner.run_sweep(
        path, str(tmp_path / name), parallel=2, launch=stand_in_launch(launched[name]),
        out=open(os.devnull, 'w'))

  beside = threading.Thread(target=sweep, args=('b', other))
  beside.start()
  sweep('a', spec)
  beside.join()
  assert list(results['a'].values()) == ['done'] * 50
  assert list(results['b'].values()) == ['done'] * 10
  for name, cells in (('a', 50), ('b', 10)):
    workdirs = [w for w, _, _ in launched[name]]
    assert len(set(workdirs)) == cells  # each cell once, in a workdir of its own
    assert all(os.path.dirname(w) == str(tmp_path / name) for w in workdirs)
    for w in workdirs:  # one process wrote each workdir, holding its lock
      rows = [json.loads(line) for line in open(os.path.join(w, 'metrics.jsonl'))]
      assert len(rows) == 1
    # --parallel=2: each cell on one XLA/OpenMP thread
    assert all('intra_op_parallelism_threads=1' in env['XLA_FLAGS'] for _, _, env in
               launched[name])
  # The sweeps' own locks were released, and kept out of their folders (whose entries are cells).
  for name, cells in (('a', 50), ('b', 10)):
    assert open(sweep_runner.lock_path(str(tmp_path / name))).read() == ''
    assert len(os.listdir(tmp_path / name)) == cells


def test_a_second_sweep_in_the_same_folder_is_refused_in_one_line(tmp_path):
  spec = write_sweep(tmp_path / 'two.py', 2)
  sweep_dir = tmp_path / 'sw'
  os.makedirs(sweep_dir)
  with sweep_runner.sweep_lock(str(sweep_dir)):  # a runner of this folder, still running
    out = subprocess.run([sys.executable, '-m', 'tools.sweep', f'--sweep={spec}',
                          f'--sweep_dir={sweep_dir}'], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f'sweep: --sweep_dir={sweep_dir} is in use by another sweep '
                               f'runner (PID {os.getpid()} on '), lines[0]
    assert os.listdir(sweep_dir) == []  # no cell started
  with pytest.raises(sweep_runner.SweepBusy):  # the library refuses alike
    with sweep_runner.sweep_lock(str(sweep_dir)):
      sweep_runner.run_sweep(spec, str(sweep_dir), launch=stand_in_launch([]))
  launched = []  # once it is free, the same command runs
  results = sweep_runner.run_sweep(spec, str(sweep_dir), launch=stand_in_launch(launched),
                                   out=open(os.devnull, 'w'))
  assert list(results.values()) == ['done', 'done'] and len(launched) == 2


@pytest.mark.parametrize('config', ['configs/mqar.py:quick', 'configs/python_code.py:quick'])
def test_two_processes_preparing_one_dataset_at_once_prepare_it_once(config, tmp_path):
  """Two train.py starts on one new data_dir at once (their data preparation, as train.py runs it
  before compiling): both end with the same dataset, built by one of them."""
  from tests.integration import test_faults_features as features
  procs = [features.prepare(config, tmp_path / 'shared') for _ in range(2)]
  errs = [p.communicate(timeout=300)[1] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], errs
  built = sum(e.count('generating the dataset') for e in errs)
  assert built == 1, errs  # the other waited on the lock and found it complete
  alone = features.prepare(config, tmp_path / 'alone')
  assert alone.wait(timeout=300) == 0
  assert features.tree(tmp_path / 'shared') == features.tree(tmp_path / 'alone')


TUNED_SWEEP = CONFIG + '''

def get_sweep():
  return {'grid': {'model.norm_position': ['pre', 'post']}, 'seeds': [0, 1]}
'''

# A tuned cell's train.py as the runner sees it: it notes its start (and whether its workdir was
# finished already) in a log, takes a while, then writes its rows (a valid loss that is lowest at
# learning rate 1e-2) and the final checkpoint.
TUNED_STAND_IN = '''
import json, math, os, sys, time
workdir, log = sys.argv[1], sys.argv[2]
rate = float(next(a for a in sys.argv if a.startswith('--config.train.learning_rate='))
           .split('=')[1])
with open(log, 'a') as f:
  done = os.path.isdir(os.path.join(workdir, 'checkpoints', '4'))
  f.write(json.dumps({'cell': os.path.basename(workdir), 'finished_before': done}) + '\\n')
time.sleep(0.5)
loss = 2.0 + abs(math.log10(rate) + 2)
with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as m:  # a resume rewrites the record
  for split in ('train', 'valid'):
    m.write(json.dumps({'step': 4, 'split': split, 'loss': loss}) + '\\n')
os.makedirs(os.path.join(workdir, 'checkpoints', '4'))
'''

TUNED_RUNNER = '''
import subprocess, sys
from tools.sweep import runner
spec, sweep_dir, log, stand_in = sys.argv[1:5]

def launch(argv, log_path, env):
  workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
  return subprocess.run([sys.executable, '-c', stand_in, workdir, log, *argv]).returncode

runner.run_sweep(spec, sweep_dir, tune='train.learning_rate:1e-3,1e-2,1e-1', parallel=2,
                 launch=launch)
'''


def test_a_tuned_sweep_sigkilled_mid_tuning_reruns_to_the_same_choices(tmp_path):
  import signal
  import time
  spec = tmp_path / 'tuned.py'
  spec.write_text(TUNED_SWEEP)
  log = tmp_path / 'launches.jsonl'

  def runner(sweep_dir, **kwargs):
    return subprocess.Popen([sys.executable, '-c', TUNED_RUNNER, str(spec), str(sweep_dir),
                             str(log), TUNED_STAND_IN], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kwargs)
  clean = runner(tmp_path / 'clean')
  assert clean.wait(timeout=300) == 0, clean.stderr.read()[-2000:]
  log.unlink()
  # SIGKILL to the runner and its cells (a lost machine) once three tuning runs have started.
  killed = runner(tmp_path / 'sw', start_new_session=True)
  deadline = time.monotonic() + 120
  while time.monotonic() < deadline and not (log.exists() and log.read_text().count('\n') >= 3):
    time.sleep(0.01)
  assert killed.poll() is None, 'the sweep ended before the kill'
  os.killpg(killed.pid, signal.SIGKILL)
  killed.wait()
  rerun = runner(tmp_path / 'sw')
  assert rerun.wait(timeout=300) == 0, rerun.stderr.read()[-2000:]
  launches = [json.loads(line) for line in log.read_text().splitlines()]
  assert not [l for l in launches if l['finished_before']]  # no cell trained again once finished
  assert len({l['cell'] for l in launches}) == 8  # 2 cells x 3 rates, then each cell's seed 1
  assert json.loads((tmp_path / 'sw' / 'tune.json').read_text()) == json.loads(
      (tmp_path / 'clean' / 'tune.json').read_text())
  chosen = [c['chosen'] for c in json.loads((tmp_path / 'sw' / 'tune.json').read_text())['cells']]
  assert chosen == [1e-2, 1e-2]
