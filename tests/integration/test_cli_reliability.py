"""The command lines under bad input and signals, run as processes: each bad input to train.py,
eval.py and tools.sweep is one line on stderr naming the flag or field and what is valid, with
exit status 2 (no traceback, nothing compiled); eval.py refuses a read-only workdir before
evaluating; a model too large for the memory limit is one line (estimate, or XLA's
RESOURCE_EXHAUSTED), never an abort; and a signal to the sweep runner reaches its cells, which
save, while no queued cell starts."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, metric_rows, quick_config
from training import loop

TRAIN = os.path.join(ROOT, 'train.py')
EVAL = os.path.join(ROOT, 'eval.py')
QUICK = f'--config={ROOT}/configs/decoder_only.py:quick'


def cli(*args, timeout=120, **kwargs):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout, **kwargs)


def assert_one_line(out, status, *needles):
  lines = out.stderr.strip().splitlines()
  assert out.returncode == status and len(lines) == 1, (out.returncode, out.stderr[-3000:])
  for needle in needles:
    assert needle in lines[0], lines[0]
  return lines[0]


@pytest.fixture(scope='module')
def bad_files(tmp_path_factory):
  d = tmp_path_factory.mktemp('bad_configs')
  (d / 'syntax.py').write_text('def get_config(\n')
  (d / 'raises.py').write_text('def get_config(arg=None):\n  raise RuntimeError("boom")\n')
  (d / 'a_dict.py').write_text('def get_config(arg=None):\n  return {"model": {}}\n')
  (d / 'sweep_syntax.py').write_text('def get_sweep(:\n')
  return d


# (argv after train.py, words the one line must contain); each exits 2.
TRAIN_CASES = [
    ([QUICK, '--config.model.foo=1'], ["model has no field 'foo'", 'valid fields of model']),
    (['--config=configs/nope.py'], ['no such file', 'configs/decoder_only.py']),
    (['--config={d}/syntax.py'], ['syntax error in', 'line 1']),
    (['--config={d}/raises.py'], ['get_config() raised RuntimeError: boom']),
    (['--config={d}/a_dict.py'], ['returned dict, not an ml_collections.ConfigDict']),
    ([f'--config={ROOT}/configs/default.py:size=huge'],
     ["size='huge'", 'base, large, small, tiny, xl']),
    ([QUICK + ',bogus=1'], ["argument 'bogus'", 'valid: quick, size']),
    ([QUICK, '--config.model.d_model=abc'], ["model.d_model='abc'", 'valid: an integer']),
    ([QUICK, '--config.model.d_model=1e9'], ["model.d_model='1e9'", 'valid: an integer']),
    ([QUICK, '--config.train.steps=1.5'], ["train.steps='1.5'", 'valid: an integer']),
    ([QUICK, '--config.train.learning_rate=nan'], ['train.learning_rate=nan', 'positive finite']),
    ([QUICK, '--config.train.learning_rate=inf'], ['train.learning_rate=inf', 'positive finite']),
    ([QUICK, '--config.train.weight_decay=nan'], ['train.weight_decay=nan', 'finite']),
    ([QUICK, '--config.train.weight_decay=inf'], ['train.weight_decay=inf', 'finite']),
    ([QUICK, '--config.model.rope_scaling_factor=nan'], ['model.rope_scaling_factor=nan']),
    ([QUICK, '--config.model.rope_scaling_factor=inf'], ['model.rope_scaling_factor=inf']),
    ([QUICK, '--config.model.rope_base=inf'], ['model.rope_base=inf', 'finite']),
    ([QUICK, '--config.train.grad_clip_norm=nan'], ['train.grad_clip_norm=nan', 'finite']),
    ([QUICK, '--config.data.data_dir='], ["data.data_dir=''", 'current directory']),
    # 8 simulated devices here (tests/conftest.py): the batch of 8 divides, the product does not.
    ([QUICK, '--config.mesh.data=2'], ['mesh.data=2', 'their product 2 must equal the device']),
    ([QUICK, '--nosuchflag=1'], ["Unknown command line flag 'nosuchflag'"]),
]


# Each refusal's message is checked in-process (tests/unit/test_bad_inputs.py); CI runs through a
# process one case of each way train.py refuses: a config file that cannot load, an override of a
# missing field, absl's value error, a validation error, the devices, an unknown flag, an empty data
# directory (checked here only). The rest are `slow`.
IN_CI = {"model has no field 'foo'", 'syntax error in', "model.d_model='abc'",
         'train.learning_rate=nan', 'mesh.data=2', "Unknown command line flag 'nosuchflag'",
         "data.data_dir=''"}


def _in_ci(cases):
  return [case if case[1][0] in IN_CI else pytest.param(*case, marks=pytest.mark.slow)
          for case in cases]


@pytest.mark.parametrize('args,needles', _in_ci(TRAIN_CASES),
                         ids=[' '.join(a)[-60:] for a, _ in TRAIN_CASES])
def test_train_bad_input_is_one_line_exit_2(tmp_path, bad_files, args, needles):
  workdir = tmp_path / 'w'
  args = [a.replace('{d}', str(bad_files)) for a in args]
  out = cli(TRAIN, *args, f'--workdir={workdir}')
  assert_one_line(out, 2, *needles)
  assert not workdir.exists()  # refused before the run began


def test_train_empty_workdir_is_refused():
  before = set(os.listdir(ROOT))
  assert_one_line(cli(TRAIN, QUICK, '--workdir='), 2, '--workdir is empty')
  assert set(os.listdir(ROOT)) == before  # nothing written into the current directory


EVAL_CASES = [
    ('--lengths=0', "--lengths=0: '0' is not valid"),
    ('--lengths=-1', "--lengths=-1: '-1' is not valid"),
    ('--lengths=abc', "--lengths=abc: 'abc' is not valid"),
    ('--lengths=1000', 'table has max_length=64 rows; valid: multiples <= 1'),
    ('--num_beams=0', '--num_beams=0 must be a positive integer'),
    ('--num_beams=-1', '--num_beams=-1 must be a positive integer'),
    ('--split=', '--split= names an empty split'),
    ('--top_p=2', '--top_p=2.0 must be in (0, 1]'),
    ('--temperature=0', '--temperature=0.0 is refused'),
    ('--stride=0', '--stride=0.0 must be in (0, 1]'),
    ('--max_examples=-1', '--max_examples=-1 must be >= 0'),
    ('--num_beams=abc', '--num_beams=abc is not valid'),
]


@pytest.fixture(scope='module')
def learned_run(tmp_path_factory, data_dir):
  """A two-step decoder-only run with a learned position table (max_length 64)."""
  workdir = tmp_path_factory.mktemp('learned_run')
  config = quick_config(data_dir, steps=2, warmup_steps=0, checkpoint_every=2, eval_every=2,
                        log_every=1)
  config.model.position = 'learned'
  loop.train_and_evaluate(config, str(workdir))
  return workdir


# In-process: tests/unit/test_bad_inputs.py (the flags) and test_eval_lengths_beyond_the_model_or_
# the_stream_are_refused (the table); CI runs the run-dependent one and absl's value error.
EVAL_IN_CI = ('--lengths=1000', '--num_beams=abc')


@pytest.mark.parametrize('flag,needle', [
    case if case[0] in EVAL_IN_CI else pytest.param(*case, marks=pytest.mark.slow)
    for case in EVAL_CASES], ids=[f for f, _ in EVAL_CASES])
def test_eval_bad_flag_is_one_line_exit_2_before_evaluating(learned_run, flag, needle):
  out = cli(EVAL, f'--workdir={learned_run}', flag)
  assert_one_line(out, 2, needle)
  assert not (learned_run / 'eval.json').exists()


def _read_only(path):
  """A command prefix under which `path` is read-only, for any user: chmod for a user, a
  read-only bind mount in a private mount namespace for root (who ignores permissions)."""
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return []
  if not shutil.which('unshare') or subprocess.run(['unshare', '-m', 'true']).returncode:
    pytest.skip('root without mount namespaces: no way to make a directory read-only here')
  return ['unshare', '-m', 'sh', '-c', f'mount --bind -o ro "{path}" "{path}" && exec "$0" "$@"']


def test_eval_on_a_read_only_workdir_stops_before_evaluating(learned_run, tmp_path):
  workdir = tmp_path / 'ro'
  shutil.copytree(learned_run, workdir)
  prefix = _read_only(workdir)
  start = time.time()
  out = subprocess.run(prefix + [sys.executable, EVAL, f'--workdir={workdir}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
  os.chmod(workdir, 0o755)
  assert_one_line(out, 2, f'cannot write eval.json in {workdir}', 'nothing was evaluated')
  assert out.stdout == '' and not (workdir / 'eval.json').exists()
  assert time.time() - start < 60


def test_eval_prints_its_results_even_when_writing_them_fails(learned_run, tmp_path):
  workdir = tmp_path / 'w'
  shutil.copytree(learned_run, workdir)
  os.makedirs(workdir / 'loss_curve.png')  # the picture cannot be written: an OSError at the end
  out = cli(EVAL, f'--workdir={workdir}', '--max_examples=4', timeout=300)
  line = assert_one_line(out, 1, 'could not write the results')
  assert 'printed above as JSON' in line
  lines = out.stdout.splitlines()
  assert lines[0].startswith('validation: loss ') and lines[1].startswith('test: loss ')
  result = json.loads(lines[-1])
  assert result['translation']['test']['n'] == 4 and result['step'] == 2


# --- Out of memory -----------------------------------------------------------------------------

def _address_space(gib):
  """A command prefix giving the child a `ulimit -v` of `gib` GiB: it cannot take more, so nothing
  big is ever allocated, whatever the machine (a shell, not preexec_fn: no fork of this JAX
  process)."""
  return ['sh', '-c', f'ulimit -v {gib * 2 ** 20} && exec "$0" "$@"', sys.executable]


def test_a_model_over_the_memory_limit_is_refused_before_compiling(tmp_path, data_dir):
  args = _address_space(8) + [TRAIN, QUICK, '--config.model.d_model=16384',
                              f'--config.data.data_dir={data_dir}', f'--workdir={tmp_path / "w"}']
  out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
  line = assert_one_line(out, 2, 'train: out of memory: estimated training memory 32.',
                         'address space left under RLIMIT_AS=8.0 GiB')
  assert 'mesh.fsdp' in line
  # Past the estimate (--nomemory_check), XLA's RESOURCE_EXHAUSTED is one line, exit 1, no abort.
  out = subprocess.run(args + ['--nomemory_check'], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  line = out.stderr.strip().splitlines()[-1]
  assert out.returncode == 1, out.stderr[-3000:]
  assert line.startswith('train: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating')
  assert 'estimated training memory 32.' in line and 'Traceback' not in out.stderr


# --- Sweeps ------------------------------------------------------------------------------------

def test_sweep_bad_inputs_are_one_line_exit_2(tmp_path, bad_files):
  out = cli('-m', 'tools.sweep', f'--sweep={bad_files}/sweep_syntax.py', f'--sweep_dir={tmp_path}')
  assert_one_line(out, 2, f'sweep file {bad_files}/sweep_syntax.py line 1: syntax error')
  out = cli('-m', 'tools.sweep', '--sweep=configs/ablations/ffn_norm.py',
            f'--sweep_dir={tmp_path}', '--seeds=a,b')
  assert_one_line(out, 2, "--seeds=a,b: 'a' is not an integer", 'comma-separated integers')
  out = cli('-m', 'tools.sweep', '--sweep=configs/ablations/ffn_norm.py',
            f'--sweep_dir={tmp_path}', '--parallel=x')
  assert_one_line(out, 2, '--parallel=x is not valid', 'valid: an integer')
  out = cli('-m', 'tools.sweep', '--sweep=configs/ablations/ffn_norm.py',
            f'--sweep_dir={tmp_path}', '--tune=model.ffn:relu,gelu')
  assert_one_line(out, 2, 'sweep error: --tune=model.ffn:relu,gelu: the sweep file already sets '
                  'model.ffn (in its grid)')
  assert os.listdir(tmp_path) == []
  (tmp_path / 'a_file').write_text('x')
  out = cli('-m', 'tools.sweep', '--sweep=configs/ablations/ffn_norm.py',
            f'--sweep_dir={tmp_path}/a_file')
  assert_one_line(out, 2, 'a_file is a file; valid: a directory')


def test_accounting_refuses_a_negative_vocabulary():
  out = cli('-m', 'tools.accounting', '--config=configs/decoder_only.py', '--vocab_size=-1')
  assert_one_line(out, 2, '--vocab_size=-1 must be positive')


LONG_SWEEP = '''
from configs import decoder_only


def get_config(arg=None):
  config = decoder_only.get_config('quick')
  config.data.data_dir = {data_dir!r}
  config.train.update(steps=100000, checkpoint_every=100000, eval_every=100000, log_every=1)
  return config


def get_sweep():
  return {{'grid': {{'model.ffn': ['relu', 'gelu', 'swiglu']}}}}
'''


@pytest.mark.parametrize('signum,parallel,to', [
    (signal.SIGINT, 1, 'pid'), (signal.SIGTERM, 1, 'pid'), (signal.SIGINT, 2, 'group')],
                         ids=['SIGINT-to-pid', 'SIGTERM-to-pid', 'ctrl-c-parallel-2'])
def test_a_signal_to_the_sweep_runner_reaches_its_cells(tmp_path, data_dir, signum, parallel, to):
  """The running cells save a checkpoint at the step they stop at; the queued cell never starts;
  the runner exits 128 + signal. `group` is a terminal's Ctrl-C: SIGINT to the runner's process
  group."""
  spec = tmp_path / 'long_sweep.py'
  spec.write_text(LONG_SWEEP.format(data_dir=str(data_dir)))
  sw = tmp_path / 'sw'
  runner = subprocess.Popen([sys.executable, '-m', 'tools.sweep', f'--sweep={spec}',
                             f'--sweep_dir={sw}', f'--parallel={parallel}'], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
  names = [f'model.ffn={f},seed=0' for f in ('relu', 'gelu', 'swiglu')]
  running = names[:parallel]
  deadline = time.time() + 90
  try:
    while time.time() < deadline:  # every running cell has logged a step: training
      if all((sw / n / 'metrics.jsonl').exists() and metric_rows(sw / n) for n in running):
        break
      assert runner.poll() is None, runner.communicate()
      time.sleep(0.1)
    if to == 'group':
      os.killpg(runner.pid, signum)
    else:
      runner.send_signal(signum)
    stdout, stderr = runner.communicate(timeout=90)
  finally:
    if runner.poll() is None:
      os.killpg(runner.pid, signal.SIGKILL)
  assert runner.returncode == 128 + signum, (stdout, stderr)
  for name in running:
    log = (sw / name / 'train.log').read_text()
    assert f'stopped by {signal.Signals(signum).name} after step' in log, log[-2000:]
    step = int(log.rsplit('after step ', 1)[1].split(';')[0])
    assert os.path.isdir(sw / name / 'checkpoints' / str(step))  # saved where it stopped
    assert f'{name}: stopped (rc {128 + signum})' in stdout
  for name in names[parallel:]:  # the queued cells never started
    assert not (sw / name).exists() and f'{name}: not started' in stdout
  assert f'sweep: stopped by {signal.Signals(signum).name}: 0/3 cells finished' in stdout
