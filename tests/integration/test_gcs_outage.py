"""An object store that cannot be reached at start (nothing listening, a name that does not
resolve) is refused in one line within seconds (exit 1), not after the clients' retries."""

import os
import socket
import subprocess
import sys
import time

from tests.helpers import ROOT

RUN = 'gs://bucket/run'


def train(data_dir, workdir, *extra, env=None, timeout=300):
  return subprocess.run(
      [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick', f'--workdir={workdir}',
       f'--config.data.data_dir={data_dir}', *extra], cwd=ROOT, capture_output=True, text=True,
      env={**os.environ, **(env or {})}, timeout=timeout)


def closed_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_a_store_that_cannot_be_reached_at_start_is_refused_at_once(data_dir):
  for host in (f'http://127.0.0.1:{closed_port()}', 'http://no-such-store.invalid:80'):
    start = time.monotonic()
    out = train(data_dir, RUN, env={'STORAGE_EMULATOR_HOST': host})
    seconds = time.monotonic() - start
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    assert len(lines) == 1 and 'cannot be reached' in lines[0], out.stderr[-2000:]
    assert host.split('//')[1] in lines[0]  # the store named
    assert seconds < 30, seconds
