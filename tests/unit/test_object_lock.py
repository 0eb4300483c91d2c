"""training.lock.ObjectLock, the lock of a gs:// workdir, against an in-memory bucket that honours
generation preconditions as GCS does (its heartbeat against the emulator:
tests/integration/test_gcs_lock.py)."""

import os
import socket
import time

from google.api_core import exceptions
import pytest

from training import lock


class FakeBlob:
  def __init__(self, bucket, name):
    self.bucket, self.name, self.generation = bucket, name, None

  def upload_from_string(self, text, if_generation_match=None, timeout=None, retry=None):
    current = self.bucket.objects.get(self.name, (None, 0))[1]
    if if_generation_match is not None and if_generation_match != current:
      raise exceptions.PreconditionFailed('generation mismatch')
    self.bucket.counter += 1
    self.bucket.objects[self.name] = (text, self.bucket.counter)
    self.generation = self.bucket.counter

  def download_as_text(self, timeout=None, retry=None):
    return self.bucket.objects[self.name][0]


class FakeBucket:
  def __init__(self):
    self.objects, self.counter = {}, 0

  def blob(self, name):
    return FakeBlob(self, name)

  def get_blob(self, name, timeout=None, retry=None):
    if name not in self.objects:
      return None
    blob = FakeBlob(self, name)
    blob.generation = self.objects[name][1]
    return blob

  def delete_blob(self, name, if_generation_match=None, timeout=None, retry=None):
    if name not in self.objects:
      raise exceptions.NotFound('no such object')
    if if_generation_match is not None and if_generation_match != self.objects[name][1]:
      raise exceptions.PreconditionFailed('generation mismatch')
    del self.objects[name]


@pytest.fixture
def bucket(monkeypatch):
  fake = FakeBucket()
  from google.cloud import storage
  monkeypatch.setattr(storage, 'Client', lambda: type('C', (), {'bucket': lambda self, n: fake})())
  return fake


def test_held_refused_then_released(bucket):
  with lock.WorkdirLock('gs://b/run') as held:
    assert isinstance(held, lock.ObjectLock)
    pid, host, _ = bucket.objects['run/lock'][0].split()
    assert (int(pid), host) == (os.getpid(), socket.gethostname())
    with pytest.raises(lock.WorkdirBusy, match=f'in use by PID {os.getpid()} on {host}, renewed'):
      lock.WorkdirLock('gs://b/run').__enter__()
  assert 'run/lock' not in bucket.objects


def test_a_lock_not_renewed_is_taken_over_with_a_note(bucket, capsys):
  old = time.time() - lock.STALE_SECS - 10
  bucket.objects['run/lock'] = (f'999999 elsewhere {old:.0f}\n', 7)
  with lock.WorkdirLock('gs://b/run'):
    assert bucket.objects['run/lock'][0].split()[0] == str(os.getpid())
  assert 'took over the stale lock of PID 999999 on elsewhere (not renewed for' in (
      capsys.readouterr().err)


def test_a_run_that_takes_the_lock_between_read_and_write_wins(bucket, monkeypatch):
  """Two runs find the same stale lock; the second write's precondition fails."""
  old = time.time() - lock.STALE_SECS - 10
  bucket.objects['run/lock'] = (f'999999 elsewhere {old:.0f}\n', 7)
  real_get = bucket.get_blob

  def get_then_lose_the_race(name):
    blob = real_get(name)
    bucket.objects[name] = ('1 winner 0\n', 8)  # the other run wrote after this one read
    return blob
  monkeypatch.setattr(bucket, 'get_blob', get_then_lose_the_race)
  with pytest.raises(lock.WorkdirBusy, match='took the lock just now'):
    lock.WorkdirLock('gs://b/run').__enter__()
  assert bucket.objects['run/lock'][0] == '1 winner 0\n'


def test_the_holder_renews_the_lock(bucket, monkeypatch):
  monkeypatch.setattr(lock, 'HEARTBEAT_SECS', 0.05)
  with lock.WorkdirLock('gs://b/run'):
    first = bucket.objects['run/lock'][1]
    time.sleep(0.3)
    assert bucket.objects['run/lock'][1] > first  # rewritten, each time on its own generation
  assert 'run/lock' not in bucket.objects


def test_a_create_whose_retry_meets_its_own_landed_write_holds_the_lock(bucket, monkeypatch):
  """The first write lands but its reply is lost; the client's retry then meets the object at a
  generation it did not expect: this run's own text, so the lock is held, not refused."""
  real = FakeBlob.upload_from_string

  def landed_then_retried(self, text, **kwargs):
    real(self, text, **kwargs)
    monkeypatch.setattr(FakeBlob, 'upload_from_string', real)
    raise exceptions.PreconditionFailed('generation mismatch')
  monkeypatch.setattr(FakeBlob, 'upload_from_string', landed_then_retried)
  with lock.WorkdirLock('gs://b/run') as held:
    assert held.generation == bucket.objects['run/lock'][1]
  assert 'run/lock' not in bucket.objects
