"""An exclusive lock on a workdir, so that two runs never write the same checkpoints and metrics.

`fcntl.flock` on WORKDIR/lock, held for the whole run by process 0 only (the other processes of a
run write nothing but their checkpoint shards, which Orbax coordinates). The kernel drops the lock
when its holder dies, however it dies, so a lock is never stale in the sense of blocking; the file
keeps the last holder's PID and host, which a second run names when it is refused, and which a
run that takes the lock over from a dead holder notes. On storage without working locks (some
network file systems) the lock may not exclude a run on another host: see README, Reliability.

A gs:// workdir has no file locks: its lock is the object WORKDIR/lock (`ObjectLock`), created only
if absent (a generation precondition, so two runs starting together cannot both create it),
holding 'PID HOST TIME'. The holder rewrites it every HEARTBEAT_SECS and deletes it at exit. A lock
object whose time is older than STALE_SECS belongs to a run that died without deleting it (killed,
its VM preempted) and is taken over with a note, as is one of a dead PID on this host. A write
whose reply was lost may still have landed: when the next conditional write or delete then finds
the generation changed, the object is read back, and if it holds a text this run wrote, its
generation is taken up; only another run's text is a takeover.
"""

import errno
import fcntl
import os
import socket
import sys
import threading
import time

from training import checkpointing
from training import paths

HEARTBEAT_SECS = 60
STALE_SECS = 300
# A heartbeat is one request, given this long: one that fails is retried by the next beat, which
# starts HEARTBEAT_SECS after it ended. A lock older than STALE_SECS may be taken over, so three
# beats in a row may fail at their longest (the renewal after them comes 4 x 70 s = 280 s after
# the last good one; after four it would come at 350 s, too late). With google-cloud-storage's own
# retries (up to 120 s) a beat that met an unreachable store held the end of a failing run, which
# waits for this thread.
BEAT_TIMEOUT_SECS = 10


class WorkdirBusy(checkpointing.IncompatibleResume):
  """Another live run holds the workdir's lock."""


def _alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, another user's
    return True
  return True


def WorkdirLock(workdir):
  """`with WorkdirLock(workdir):` holds the lock, or raises WorkdirBusy naming the holder."""
  return ObjectLock(workdir) if paths.is_remote(workdir) else FileLock(workdir)


def _busy(workdir, lock_path, who):
  return WorkdirBusy(f'{workdir} is in use by {who} (lock {lock_path}); wait for that run to end '
                     'or use another --workdir')


class FileLock:
  """The lock of a local workdir: `fcntl.flock` on WORKDIR/lock."""

  def __init__(self, workdir):
    self.path = os.path.join(workdir, 'lock')
    self.fd = None

  def __enter__(self):
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.pread(fd, 200, 0).decode(errors='replace').split()
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise
      who = f'PID {holder[0]} on {holder[1]}' if len(holder) >= 2 else 'another run'
      raise _busy(os.path.dirname(self.path), self.path, who) from None
    previous = os.pread(fd, 200, 0).decode(errors='replace').split()
    host = socket.gethostname()
    if len(previous) >= 2 and previous[0].isdigit():
      pid, where = int(previous[0]), previous[1]
      if where == host and pid != os.getpid() and not _alive(pid):
        print(f'train: took over the stale lock of PID {pid} on {host} (no longer running) in '
              f'{self.path}', file=sys.stderr)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f'{os.getpid()} {host}\n'.encode(), 0)
    os.fsync(fd)
    self.fd = fd
    return self

  def __exit__(self, *exc):
    if self.fd is not None:
      os.ftruncate(self.fd, 0)  # a holder named in the file did not end cleanly
      fcntl.flock(self.fd, fcntl.LOCK_UN)
      os.close(self.fd)
      self.fd = None


class ObjectLock:
  """The lock of a gs:// workdir: the object WORKDIR/lock (see the module docstring).

  Uses google-cloud-storage (a dependency of gcsfs) for the generation preconditions that epath
  does not expose; STORAGE_EMULATOR_HOST points it at an emulator.
  """

  def __init__(self, workdir):
    self.workdir = workdir
    self.path = paths.join(workdir, 'lock')
    bucket, _, self.name = self.path.split('://', 1)[1].partition('/')
    from google.cloud import storage
    self.bucket = storage.Client().bucket(bucket)
    self.generation, self.stop = None, threading.Event()
    self.pending = []  # the texts written since the last write known to have landed
    self.thread = None

  def _text(self):
    return f'{os.getpid()} {socket.gethostname()} {time.time():.0f}\n'

  def __enter__(self):
    from google.api_core import exceptions
    blob = self.bucket.get_blob(self.name)
    if blob is not None:
      holder = blob.download_as_text().split()
      if not self._stale(holder):
        raise _busy(self.workdir, self.path, f'PID {holder[0]} on {holder[1]}, renewed '
                    f'{time.time() - float(holder[2]):.0f} s ago' if len(holder) >= 3 else
                    'another run')
    try:
      # Only if the object is still the one read (or still absent): a run that took it meanwhile
      # wins, and this one is refused.
      self._write(blob.generation if blob else 0)
    except exceptions.PreconditionFailed:
      if not self._adopt():  # not this run's own write, landed before a retry
        raise _busy(self.workdir, self.path, 'another run (it took the lock just now)') from None
    self.thread = threading.Thread(target=self._heartbeat, daemon=True, name='workdir-lock')
    self.thread.start()
    return self

  def _stale(self, holder):
    """Whether the lock object's holder ('PID HOST TIME') is dead: a dead PID on this host, or
    not renewed for STALE_SECS. The note names it."""
    if len(holder) < 3 or not holder[0].isdigit():
      return True  # not a lock this code wrote whole
    pid, host, age = int(holder[0]), holder[1], time.time() - float(holder[2])
    if host == socket.gethostname() and pid != os.getpid() and not _alive(pid):
      reason = 'no longer running'
    elif age > STALE_SECS:
      reason = f'not renewed for {age:.0f} s'
    else:
      return False
    print(f'train: took over the stale lock of PID {pid} on {host} ({reason}) in {self.path}',
          file=sys.stderr)
    return True

  def _write(self, generation, **request):
    """Writes 'PID HOST TIME' if the object is at `generation` (0: absent); keeps the new one."""
    text = self._text()
    self.pending.append(text)
    blob = self.bucket.blob(self.name)
    blob.upload_from_string(text, if_generation_match=generation, **request)
    self.generation, self.pending = blob.generation, []

  def _adopt(self, **request):
    """After a precondition failed: whether the object is one that this run wrote while its
    generation was not known (a write that landed but whose reply was lost, or a retry after it),
    its generation then taken up. Anything else is another run's lock."""
    blob = self.bucket.get_blob(self.name, **request)
    if blob is None or blob.download_as_text(**request) not in self.pending:
      return False
    self.generation, self.pending = blob.generation, []
    return True

  def _heartbeat(self):
    while not self.stop.wait(HEARTBEAT_SECS):
      if not self._beat():
        print(f'train: warning: the lock {self.path} was taken over by another run',
              file=sys.stderr)
        return

  def _beat(self):
    """One renewal: False once another run holds the lock. Each request is one try of at most
    BEAT_TIMEOUT_SECS; a beat that fails otherwise is retried by the next one."""
    from google.api_core import exceptions
    one_try = {'timeout': BEAT_TIMEOUT_SECS, 'retry': None}
    try:
      try:
        self._write(self.generation, **one_try)
      except exceptions.PreconditionFailed:
        if not self._adopt(**one_try):
          return False
        self._write(self.generation, **one_try)
    except Exception:  # noqa: BLE001
      pass
    return True

  def __exit__(self, *exc):
    self.stop.set()
    if self.thread is not None:
      self.thread.join()
    failing = bool(exc) and exc[0] is not None
    try:
      # Failing (the store unreachable, say): one try, no retries.
      self._delete(**({'timeout': BEAT_TIMEOUT_SECS, 'retry': None} if failing else {}))
    except Exception:
      if not failing:
        raise
      # Left behind: the rerun on this host takes it over (its PID is dead), any other after
      # STALE_SECS; the failure already propagating says what went wrong.

  def _delete(self, **request):
    from google.api_core import exceptions
    try:
      try:
        self.bucket.delete_blob(self.name, if_generation_match=self.generation, **request)
      except exceptions.PreconditionFailed:
        if self._adopt(**request):  # the last beat landed, its reply lost
          self.bucket.delete_blob(self.name, if_generation_match=self.generation, **request)
    except (exceptions.NotFound, exceptions.PreconditionFailed):
      pass  # taken over (the heartbeat said so), or already gone
