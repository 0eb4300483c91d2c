"""The object store lost while a checkpoint is written to it: train.py ends in one line naming the
store and the last confirmed checkpoint (exit 1), no trace on the terminal; once the store is back
the same command resumes and ends with the uninterrupted run's rows.

The local GCS emulator keeps its objects on disk here (tests.helpers.start_gcs_emulator), so that
it can die mid-save and be started again on the same port with the objects it had. It dies by
itself as it is about to write the first object of the step's checkpoint, whatever the load.
"""

import os
import re
import subprocess
import sys
import threading
import time

from tests.helpers import GCS_DIED, ROOT, free_port, gcs_env, start_gcs_emulator
from training import lock
from training import writers

RUN = 'gs://bucket/run'
KEYS = ('step', 'split', 'loss', 'accuracy', 'grad_norm', 'param_norm', 'learning_rate')


def command(data_dir, workdir):
  return [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
          f'--config.data.data_dir={data_dir}', '--config.train.steps=8',
          '--config.train.checkpoint_every=4', '--config.train.log_every=1',
          '--config.train.eval_every=4', f'--workdir={workdir}']


def rows(path):
  return [tuple(r.get(k) for k in KEYS) for r in writers.read_metrics(str(path), warn=False)]


def test_the_store_lost_mid_save_ends_in_one_line_and_the_rerun_resumes(data_dir, tmp_path):
  full = subprocess.run(command(data_dir, tmp_path / 'full'), cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert full.returncode == 0, full.stderr[-3000:]
  uninterrupted = rows(tmp_path / 'full' / 'metrics.jsonl')

  port, storage = free_port(), tmp_path / 'store'
  url = f'http://127.0.0.1:{port}'
  env = {**os.environ, **gcs_env(url, TENSORSTORE_GCS_HTTP_URL='{url}',
                                 GOOGLE_AUTH_TOKEN_FOR_TESTING='emulator',
                                 TENSORSTORE_GCS_REQUEST_CONCURRENCY='8',
                                 ATTNLAB_DATA_CACHE=str(tmp_path / 'cache'))}
  # The store dies once the last checkpoint (step 8, after the confirmed step 4) is being
  # written: the emulator exits itself as it is about to write the step's first object.
  emulator, cut = start_gcs_emulator(port, storage, die_at='bucket/run/checkpoints/8/'), None
  try:
    cut = subprocess.Popen(command(data_dir, RUN), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600  # against a hang only
    while emulator.poll() is None and cut.poll() is None and time.monotonic() < deadline:
      time.sleep(0.05)
    killed = time.monotonic()
    assert emulator.poll() == GCS_DIED, (
        f'the store was not lost at step 8 (emulator {emulator.poll()}, run {cut.poll()}): '
        + (cut.communicate()[1][-3000:] if cut.poll() is not None else ''))
    out, err = cut.communicate(timeout=400)
    print(f'the run ended {time.monotonic() - killed:.0f} s after the store was lost')
    assert cut.returncode == 1, err[-3000:]
    terminal = out + err
    assert 'Traceback' not in terminal and 'Event loop is closed' not in terminal, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith(f'train: the object store 127.0.0.1:{port} of {RUN} stopped '
                           'answering ('), line
    assert '; the last good checkpoint is step 4; rerun the same command once it is back' in line
    traces = re.search(r"\(its threads' traces, if any: (\S+)\)$", line).group(1)
    assert traces.endswith(os.path.join('logs', 'save-threads.log')), line
    if os.path.exists(traces):  # only the closed event loop's traces went there
      text = open(traces).read()
      assert text.count('Traceback') == text.count('RuntimeError: Event loop is closed'), text

    emulator = start_gcs_emulator(port, storage)  # the store is back, with its objects
    rerun = subprocess.run(command(data_dir, RUN), cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f'train: resumed from step 4 in {RUN}' in rerun.stderr, rerun.stderr[-3000:]
    # The object as the emulator keeps it on its disk.
    assert rows(storage / '.cloudstorage' / 'bucket' / 'run' / 'metrics.jsonl') == uninterrupted
  finally:
    if cut is not None and cut.poll() is None:  # a run that outlived its wait
      cut.kill()
      cut.wait()
    emulator.kill()
    emulator.wait()


def test_a_lock_heartbeat_against_a_lost_store_does_not_hold_a_failing_exit(monkeypatch,
                                                                           tmp_path):
  """A beat that meets the store gone is one request: the failing run's exit, which waits for the
  heartbeat thread, does not wait out google-cloud-storage's retries (up to 120 s)."""
  port = free_port()
  for key, value in gcs_env(f'http://127.0.0.1:{port}').items():
    monkeypatch.setenv(key, value)
  monkeypatch.setattr(lock, 'HEARTBEAT_SECS', 0.2)
  emulator = start_gcs_emulator(port)
  try:
    held = lock.ObjectLock('gs://bucket/run')
    held.__enter__()
  finally:
    emulator.kill()
    emulator.wait()
  time.sleep(1)  # beats meet the store gone
  exiting = threading.Thread(target=held.__exit__, args=(OSError, OSError('lost'), None),
                             daemon=True)
  exiting.start()
  exiting.join(timeout=60)
  assert not exiting.is_alive(), 'the exit waited on the heartbeat\'s retries'


def test_the_emulator_on_disk_keeps_an_object_and_one_named_like_a_temporary_file_apart(
    monkeypatch, tmp_path):
  """Each write goes through a temporary file, named where no object's file can be."""
  port = free_port()
  for key, value in gcs_env(f'http://127.0.0.1:{port}').items():
    monkeypatch.setenv(key, value)
  emulator = start_gcs_emulator(port, tmp_path / 'store')
  try:
    from google.cloud import storage
    bucket = storage.Client().bucket('bucket')
    names = ('run/x.partial', 'run/x', 'run/x.tmp')
    for name in names:
      bucket.blob(name).upload_from_string(name)
    assert [bucket.blob(name).download_as_text() for name in names] == list(names)
  finally:
    emulator.kill()
    emulator.wait()
