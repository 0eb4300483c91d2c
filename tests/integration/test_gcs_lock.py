"""training.lock.ObjectLock's heartbeat against the local GCS emulator (which honours generation
preconditions, tests.helpers.GCS_LAUNCHER): a beat that lands but whose reply is lost is not taken
for another run's takeover; a real foreign write still is."""

import itertools
import threading

from google.cloud import storage
import pytest
import requests

from tests.helpers import free_port, gcs_env, start_gcs_emulator
from training import lock

RUN = 'gs://bucket/run'
TAKEN_OVER = 'was taken over by another run'


@pytest.fixture
def bucket(monkeypatch):
  """The emulator's bucket `bucket`; google-cloud-storage pointed at it, beats every 0.05 s."""
  port = free_port()
  for key, value in gcs_env(f'http://127.0.0.1:{port}').items():
    monkeypatch.setenv(key, value)
  monkeypatch.setattr(lock, 'HEARTBEAT_SECS', 0.05)
  emulator = start_gcs_emulator(port)
  try:
    yield storage.Client().bucket('bucket')
  finally:
    emulator.kill()
    emulator.wait()


def beats(monkeypatch, *, lost=()):
  """Counts the heartbeat's uploads (those with its one-try timeout); the ones numbered in `lost`
  land on the store, and then their reply is lost (a read timeout). Returns an event per beat."""
  real, count = storage.Blob.upload_from_string, itertools.count()
  done = [threading.Event() for _ in range(10)]

  def upload(self, *args, timeout=60, **kwargs):
    real(self, *args, timeout=timeout, **kwargs)
    if timeout == lock.BEAT_TIMEOUT_SECS:
      n = next(count)
      if n < len(done):
        done[n].set()
      if n in lost:
        raise requests.exceptions.ReadTimeout('the reply was lost')
  monkeypatch.setattr(storage.Blob, 'upload_from_string', upload)
  return done


def test_a_beat_whose_reply_was_lost_is_not_a_takeover(bucket, monkeypatch, capfd):
  done = beats(monkeypatch, lost={0})  # the first beat lands; its new generation is not known
  held = lock.ObjectLock(RUN)
  held.__enter__()
  try:
    # The second beat's precondition fails (the stale generation); this run's own text is found
    # there and its generation taken up, and the beats go on.
    assert done[3].wait(timeout=60), 'the heartbeat stopped: ' + capfd.readouterr().err
    assert held.thread.is_alive()
  finally:
    held.__exit__(None, None, None)
  assert TAKEN_OVER not in capfd.readouterr().err
  assert bucket.get_blob('run/lock') is None  # released: the delete's generation was current


def test_a_foreign_write_is_still_a_takeover(bucket, monkeypatch, capfd):
  done = beats(monkeypatch)
  held = lock.ObjectLock(RUN)
  held.__enter__()
  try:
    assert done[0].wait(timeout=60)
    bucket.blob('run/lock').upload_from_string('1 elsewhere 0\n')  # another run took it
    held.thread.join(timeout=60)
    assert not held.thread.is_alive()
  finally:
    held.__exit__(None, None, None)
  assert TAKEN_OVER in capfd.readouterr().err
  assert bucket.blob('run/lock').download_as_text() == '1 elsewhere 0\n'  # left to its holder
