"""A dataset preparation that runs out of disk space: one line naming the folder and the free
space, instead of a traceback from deep inside TFDS or a file write."""

import contextlib
import errno
import io
import os
import shutil
import sys
import time

# The errors of a full disk, a file over RLIMIT_FSIZE and a full quota; TFDS's array_record writer
# reports them as a RuntimeError carrying the same words.
DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
DISK_REASONS = tuple(os.strerror(n) for n in DISK_ERRNOS)


class PreparationFailed(Exception):
  """Writing a prepared dataset failed for want of space; the message is one line."""


def free_space(path: str) -> str:
  """The free space of the file system holding `path` (or its nearest existing parent)."""
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  try:
    free = shutil.disk_usage(path or '.').free
  except OSError:
    return 'unknown'
  return f'{free / 2**30:.1f} GiB' if free >= 2**30 else f'{free / 2**20:.1f} MiB'


def disk_reason(e: BaseException) -> str | None:
  """The disk error `e` reports (None: another error)."""
  if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
    return e.strerror
  return next((r for r in DISK_REASONS if r in str(e)), None) if isinstance(
      e, (OSError, RuntimeError)) else None


@contextlib.contextmanager
def preparing(folder: str, what: str):
  """Around the writes of a preparation into `folder`: a disk error becomes PreparationFailed.

  The builders keep nothing half-written (each writes into a temporary name and renames, or marks
  completion last), so the same command prepares the dataset afresh once there is room.

  TFDS's own banner ("Downloading and preparing dataset Unknown size ...") is printed to stdout
  and is wrong here (every dataset is generated on this host; nothing is downloaded): it gives way
  to one line on stderr once a TFDS preparation succeeded (one that fails, on a bad file or a
  vocabulary too large, stays the one line of its error; a preparation without TFDS says nothing).
  """
  start, banner = time.monotonic(), io.StringIO()
  try:
    with contextlib.redirect_stdout(banner):
      yield
    if banner.getvalue():
      print(f'data: prepared {what} in {folder} in {time.monotonic() - start:.0f} s (generated '
            'here, nothing downloaded; later runs reuse it)', file=sys.stderr, flush=True)
  except (OSError, RuntimeError) as e:
    reason = disk_reason(e)
    if reason is None:
      raise
    raise PreparationFailed(
        f'preparing {what} in {folder} failed: {reason} ({free_space(folder)} free); nothing '
        'half-written is kept: make room and rerun the same command') from None
