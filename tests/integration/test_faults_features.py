"""The newer features under faults: a dataset builder killed mid-preparation or out of disk space,
`tools.hf import` killed mid-write, and `tools.aot --sweep` interrupted."""

import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT

# What train.py does with a config's data before it compiles anything: the dataset prepared on
# first use (the code corpus's files first), its tokenizer read; a line on stderr each time TFDS
# writes a dataset.
PREPARE = '''
import sys
from training import host
host.cpu_when_no_accelerator()
from training import config_file, validation
from data import pipeline
import tensorflow_datasets as tfds
_generate = tfds.core.GeneratorBasedBuilder._download_and_prepare
def generate(self, *args, **kwargs):  # called only when TFDS writes the dataset
  print('generating the dataset', file=sys.stderr)
  return _generate(self, *args, **kwargs)
tfds.core.GeneratorBasedBuilder._download_and_prepare = generate
config = config_file.load_config_file(sys.argv[1])
for flag in sys.argv[3:]:  # --config.data.FIELD=VALUE, as train.py takes it
  field, value = flag.removeprefix('--config.data.').split('=', 1)
  config.data[field] = value
config = validation.resolve(config)
config.data.data_dir = sys.argv[2]
pipeline.get_tokenizer(config.data)
'''

# A converted Hugging Face checkpoint's tokenizer (tokenizer.json beside its weights, as
# `python -m tools.hf import` copies it into WORKDIR/tokenizer and configs/pretrained.py passes it).
HF_TOKENIZER = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')

# (config, train.py flags, a path fragment that exists only while the preparation writes)
BUILDERS = {
    'mqar': ('configs/mqar.py:quick', (), 'incomplete.'),  # TFDS's temporary dataset folder
    'python_code': ('configs/python_code.py:quick', (), '.tmp'),  # text_corpus's temporary folder
    # The code corpus with the HF tokenizer (nothing to train): killed while TFDS writes its
    # records inside text_corpus's temporary folder.
    'python_code_hf': ('configs/python_code.py:quick', (f'--config.data.tokenizer={HF_TOKENIZER}',),
                       'incomplete.'),
}


def prepare(config, data_dir, flags=(), **kwargs):
  return subprocess.Popen([sys.executable, '-c', PREPARE, config, str(data_dir), *flags],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs)


def tree(data_dir):
  """{relative path: content} of every file under data_dir but the locks: the bytes, or, of a
  dataset's array_record file, its records (the writer's bytes differ from run to run)."""
  from data import generated
  out = {}
  for d, _, files in os.walk(data_dir):
    for f in files:
      path = os.path.join(d, f)
      if f.endswith('.lock') or f == 'dataset_info.json':  # the info holds a timestamp
        continue
      if '.array_record-' in f:
        split = f.split('-')[1].split('.')[0]
        content = generated.read_records(d, split)
      else:  # corpus.json names its files by their absolute paths
        content = open(path, 'rb').read().replace(str(data_dir).encode(), b'DATA_DIR')
      out[os.path.relpath(path, data_dir)] = content
  return out


def kill_when(proc, data_dir, fragment, timeout=120):
  """SIGKILL `proc` once a path under data_dir holds `fragment`; whether it was still running."""
  deadline = time.monotonic() + timeout
  while proc.poll() is None and time.monotonic() < deadline:
    for d, dirs, files in os.walk(data_dir):
      if any(fragment in name for name in dirs + files):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return True
    time.sleep(0.001)
  return False


@pytest.mark.parametrize('builder', sorted(BUILDERS))
def test_a_builder_killed_mid_preparation_prepares_afresh(builder, tmp_path):
  config, flags, fragment = BUILDERS[builder]
  clean = prepare(config, tmp_path / 'clean', flags)
  assert clean.wait(timeout=300) == 0, clean.stderr.read()[-2000:]
  killed = prepare(config, tmp_path / 'killed', flags)
  assert kill_when(killed, tmp_path / 'killed', fragment), 'the preparation ended before the kill'
  rerun = prepare(config, tmp_path / 'killed', flags)
  assert rerun.wait(timeout=300) == 0, rerun.stderr.read()[-2000:]
  # The rerun ends with the very files of an uninterrupted preparation: nothing of the killed one
  # is read or kept (its temporary folder is gone).
  clean_files, rerun_files = tree(tmp_path / 'clean'), tree(tmp_path / 'killed')
  assert sorted(rerun_files) == sorted(clean_files)
  assert rerun_files == clean_files


@pytest.mark.parametrize('builder', sorted(BUILDERS))
def test_a_full_disk_while_preparing_is_one_line_exit_1(builder, tmp_path):
  """RLIMIT_FSIZE fails the dataset's writes as a full disk would."""
  def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
  config, flags, _ = BUILDERS[builder]
  data_dir = tmp_path / 'tfds'
  out = subprocess.run([sys.executable, 'train.py', f'--config={config}', *flags,
                        f'--config.data.data_dir={data_dir}', f'--workdir={tmp_path / "w"}'],
                       cwd=ROOT, capture_output=True, text=True, preexec_fn=limit, timeout=300)
  assert out.returncode == 1, out.stderr[-2000:]
  lines = out.stderr.strip().splitlines()
  assert 'Traceback' not in out.stderr, out.stderr[-2000:]
  assert lines[-1].startswith('train: preparing the ') and 'File too large' in lines[-1]
  assert ' free); nothing half-written is kept' in lines[-1], lines[-1]
  # Nothing a later run could take for a prepared dataset: no tokenizer, manifest or stray file.
  left = [os.path.relpath(os.path.join(d, f), data_dir) for d, _, fs in os.walk(data_dir)
          for f in fs if not f.endswith('.lock')]
  assert left == [], left


def test_hf_import_killed_mid_write_leaves_no_workdir_and_the_rerun_completes(tmp_path):
  hf_dir = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')
  command = [sys.executable, '-m', 'tools.hf', 'import', f'--hf_dir={hf_dir}']
  workdir = tmp_path / 'imported'
  partial = tmp_path / 'imported.partial'
  proc = subprocess.Popen(command + [f'--workdir={workdir}'], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.monotonic() + 120
  while proc.poll() is None and time.monotonic() < deadline and not partial.exists():
    time.sleep(0.001)
  assert proc.poll() is None, 'the import ended before the kill'
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not workdir.exists()  # nothing train.py or configs/pretrained.py would take for a run
  out = subprocess.run(command + [f'--workdir={workdir}'], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert not partial.exists()
  clean = subprocess.run(command + [f'--workdir={tmp_path / "clean"}'], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
  assert clean.returncode == 0, clean.stderr[-2000:]
  from tools.hf import export
  ids = list(range(1, 17))
  np.testing.assert_array_equal(export.logits(str(workdir), ids),
                                export.logits(str(tmp_path / 'clean'), ids))


@pytest.mark.parametrize('signum', [signal.SIGINT, signal.SIGTERM])
def test_aot_sweep_interrupted_is_one_line_and_no_partial_report(signum):
  # SIGINT as a terminal delivers it: a test run started in the background of a non-interactive
  # shell (`cmd &`) inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored.
  proc = subprocess.Popen([sys.executable, '-m', 'tools.aot', '--topology=v5p:2x2x1',
                           '--sweep=configs/ablations/ffn_norm.py:quick', '--json'], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  time.sleep(12)  # libtpu is up and the first cells compile
  assert proc.poll() is None, 'the sweep compiled before the signal'
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + signum, err[-2000:]
  assert 'Traceback' not in err, err[-2000:]
  name = signal.Signals(signum).name
  assert err.strip().splitlines()[-1].startswith(f'aot: stopped by {name} after compiling ')
  assert 'no report was printed' in err
  assert out == ''  # no table, no JSON of the cells compiled so far


def test_compare_leaves_out_a_running_cell_and_a_damaged_one_naming_each(tmp_path):
  import socket
  from tests.helpers import write_run
  from tools.compare import comparison
  sweep = tmp_path / 'sw'
  curve = [(step, 3.0 - step / 100) for step in range(10, 101, 10)]
  for norm in ('pre', 'post'):
    for seed in range(3):
      write_run(sweep / f'norm={norm},seed={seed}', curve, [(100, 2.0 + seed / 100)], seed=seed,
                fields={'norm_position': norm})
  # A cell still training (its lock names this live process), and one whose metrics.jsonl holds a
  # line that is not a row.
  (sweep / 'norm=post,seed=2' / 'lock').write_text(f'{os.getpid()} {socket.gethostname()}\n')
  with open(sweep / 'norm=pre,seed=1' / 'metrics.jsonl', 'r+') as f:
    lines = f.readlines()
    lines[3] = '{"step": 40, "spl\n'
    f.seek(0)
    f.writelines(lines)
  text = comparison.compare([str(sweep)], str(tmp_path / 'c.png'))
  head = text.split('\n\n')[0].splitlines()
  assert head[0] == 'Left out: 2 runs (the statistics count the seeds of the others).'
  assert head[1].startswith('- norm=post,seed=2: still running (PID ')
  assert head[2].startswith('- norm=pre,seed=1: ') and 'line 4 is not a metrics row' in head[2]
  stats = text[text.index('Statistics'):]
  rows = [line for line in stats.splitlines() if line.startswith('| final_valid')]
  assert len(rows) == 2 and all('| 2 |' in row for row in rows), stats  # 2 seeds each
  # A lock emptied by a clean exit, or left by a dead process, is not a running cell.
  (sweep / 'norm=post,seed=2' / 'lock').write_text('')
  text = comparison.compare([str(sweep)], str(tmp_path / 'c.png'))
  assert text.startswith('Left out: 1 run ')
