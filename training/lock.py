"""An exclusive lock on a workdir, so that two runs never write the same checkpoints and metrics.

`fcntl.flock` on WORKDIR/lock, held for the whole run by process 0 only (the other processes of a
run write nothing but their checkpoint shards, which Orbax coordinates). The kernel drops the lock
when its holder dies, however it dies, so a lock is never stale in the sense of blocking; the file
keeps the last holder's PID and host, which a second run names when it is refused, and which a
run that takes the lock over from a dead holder notes. On storage without working locks (some
network file systems) the lock may not exclude a run on another host: see README, Reliability.
"""

import errno
import fcntl
import os
import socket
import sys

from training import checkpointing


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


class WorkdirLock:
  """`with WorkdirLock(workdir):` holds the lock, or raises WorkdirBusy naming the holder."""

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
      raise WorkdirBusy(f'{os.path.dirname(self.path)} is in use by {who} (lock {self.path}); '
                        'wait for that run to end or use another --workdir') from None
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
