"""A failed save reads as one line: the traces tensorstore's threads print as they find Orbax's
event loop closed go to WORKDIR/logs/save-threads.log, which the line names, on a nearly full disk
(50 KB of room) and on a read-only checkpoints directory; the rerun with room ends as the
uninterrupted run."""

import os
import resource
import signal
import subprocess
import sys

import pytest

from data import pipeline
from tests.helpers import ROOT, metric_rows, quick_config

KEYS = ('step', 'split', 'loss', 'accuracy', 'grad_norm')


def command(data_dir, workdir):
  return [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
          f'--config.data.data_dir={data_dir}', '--config.train.steps=12',
          '--config.train.checkpoint_every=4', '--config.train.eval_every=100',
          f'--workdir={workdir}']


def assert_one_line(out, workdir, reason):
  """Exit 1, the failed save's line naming the log, and not one trace on the terminal."""
  assert out.returncode == 1, out.stderr[-3000:]
  assert 'Traceback' not in out.stderr and 'Event loop' not in out.stderr, out.stderr[-3000:]
  line = out.stderr.strip().splitlines()[-1]
  assert line.startswith('train: saving a checkpoint') and reason in line, out.stderr[-3000:]
  assert line.endswith(f"(its threads' traces, if any: {workdir}/logs/save-threads.log)"), line


def rows(data_dir, workdir):
  """The metrics rows after running the command (to its end) in `workdir`."""
  out = subprocess.run(command(data_dir, workdir), cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return [tuple(r.get(k) for k in KEYS) for r in metric_rows(workdir)]


@pytest.fixture(scope='module')
def uninterrupted(data_dir, tmp_path_factory):
  return rows(data_dir, tmp_path_factory.mktemp('full'))


def test_a_nearly_full_disk_fails_the_save_in_one_line(data_dir, tmp_path, uninterrupted):
  """RLIMIT_FSIZE at 50 KB: the checkpoint's first data file cannot be written (as a full disk)."""
  pipeline.get_tokenizer(quick_config(data_dir).data)  # the dataset is written before the limit

  def limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))
  out = subprocess.run(command(data_dir, tmp_path / 'cut'), cwd=ROOT, capture_output=True,
                       text=True, preexec_fn=limit, timeout=300)
  assert_one_line(out, tmp_path / 'cut', 'File too large')
  assert rows(data_dir, tmp_path / 'cut') == uninterrupted  # the rerun, with room


def test_a_read_only_checkpoints_directory_fails_the_save_in_one_line(data_dir, tmp_path,
                                                                      uninterrupted):
  """A read-only bind mount over WORKDIR/checkpoints (root only: skipped elsewhere)."""
  checkpoints = tmp_path / 'cut' / 'checkpoints'
  checkpoints.mkdir(parents=True)
  mount = ['mount', '--bind', str(checkpoints), str(checkpoints)]
  if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
    pytest.skip('a read-only bind mount needs root')
  try:
    subprocess.run(['mount', '-o', 'remount,bind,ro', str(checkpoints)], check=True)
    out = subprocess.run(command(data_dir, tmp_path / 'cut'), cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
  finally:
    subprocess.run(['umount', str(checkpoints)], check=True)
  assert_one_line(out, tmp_path / 'cut', 'Read-only file system')
  assert rows(data_dir, tmp_path / 'cut') == uninterrupted  # the rerun, with room
