"""Checkpoint writes to an object store that stops answering give up within a bounded window
(training.checkpointing.STORE_RETRIES), not after tensorstore's quarter of an hour of retries."""

import os
import socket
import subprocess
import sys
import time

from tests.helpers import ROOT

WRITE = '''
import sys, time
import tensorstore as ts
from training import checkpointing  # bounds the retries of every context Orbax creates
from orbax.checkpoint._src.serialization import tensorstore_utils
context = tensorstore_utils.get_ts_context(use_ocdbt=True)
start = time.monotonic()
try:
  ts.KvStore.open({'driver': 'gcs', 'bucket': 'bucket'}, context=context).result().write(
      'a', b'x').result()
except ValueError as e:
  print(round(time.monotonic() - start, 1), str(e).splitlines()[0][:120])
'''


def test_a_checkpoint_write_to_an_unreachable_store_gives_up_within_the_window():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]  # nothing listens there once the socket is closed
  env = {**os.environ, 'TENSORSTORE_GCS_HTTP_URL': f'http://127.0.0.1:{port}',
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test', 'JAX_PLATFORMS': 'cpu'}
  start = time.monotonic()
  out = subprocess.run([sys.executable, '-c', WRITE], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
  seconds, message = out.stdout.split(' ', 1)
  # 1 + 2 + 4 + 8 + 8 s of backoff between the 6 tries (tensorstore's default: 32 tries up to 32 s
  # apart, about 15 minutes).
  assert f'All {checkpointing_retries()} retry attempts failed' in message, out.stdout + out.stderr
  assert 20 < float(seconds) < 60 and time.monotonic() - start < 90, seconds


def checkpointing_retries():
  from training import checkpointing
  return checkpointing.STORE_RETRIES['max_retries']
