"""The sweep runner's cell processes, and the SIGINT/SIGTERM it forwards to them."""

import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from training import host

# The repository root (tools/sweep/ is two below it): cells run from here.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


WAIT_SECS = 600  # how long a cell waits for a run of an earlier runner to release its workdir


def wait_for_workdir(argv, log, timeout=WAIT_SECS):
  """Waits while another process holds the lock of the local `--workdir` in `argv` (a cell of an
  earlier runner, still saving after that runner was killed), saying so once in `log` and on
  stderr; after `timeout` the cell starts anyway and train.py refuses in one line."""
  workdir = next((a.split('=', 1)[1] for a in argv if a.startswith('--workdir=')), None)
  if workdir is None or '://' in workdir or not os.path.exists(os.path.join(workdir, 'lock')):
    return
  deadline, said = time.monotonic() + timeout, False
  while time.monotonic() < deadline:
    with open(os.path.join(workdir, 'lock'), 'a+') as f:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
        return
      except OSError:
        f.seek(0)
        parts = f.read().split()  # 'PID HOST' (training.lock)
        holder = f'PID {parts[0]} on {parts[1]}' if len(parts) >= 2 else 'another process'
    if not said:
      line = f'sweep: {workdir} is still held by {holder} (a run of an earlier sweep); waiting\n'
      log.write(line)
      log.flush()
      sys.stderr.write(line)
      said = True
    time.sleep(1.0)


class Children:
  """The cells' running processes, and the signal that stops the sweep (0: none yet).

  Each cell runs in its own session, so a Ctrl-C at the terminal reaches the runner only, and the
  runner forwards it exactly once per signal received: `subprocess.run` would kill a child that a
  SIGINT interrupted before it saved, and a SIGTERM to the runner alone would leave it orphaned.
  """

  def __init__(self):
    self.procs = set()
    self.signum = 0

  def forward(self, signum, frame=None):
    """The signal handler: remember the first signal, pass this one on to every running cell."""
    del frame
    self.signum = self.signum or signum
    for proc in list(self.procs):
      try:
        proc.send_signal(signum)
      except OSError:  # it has just exited
        pass

  def launch(self, argv, log_path, env):
    """Runs argv from the repository root, appending its output to log_path; returns the exit code
    (None when the sweep was stopped before it could start)."""
    if self.signum:
      return None
    with open(log_path, 'a') as log:
      log.write(f'\n$ {shlex.join(argv)}\n')
      log.flush()
      wait_for_workdir(argv, log)
      # SIGTERM when the runner's thread that started it dies, however it dies (SIGKILL
      # included), so the cell saves a checkpoint and stops instead of running on, orphaned.
      proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env={**env, **host.parent_death_env(signal.SIGTERM)},
                              start_new_session=True)
      self.procs.add(proc)
      if self.signum:  # the signal came between the check above and Popen: pass it on too
        proc.send_signal(self.signum)
      try:
        return proc.wait()
      finally:
        self.procs.discard(proc)

  @contextlib.contextmanager
  def handling(self):
    """A context in which SIGINT and SIGTERM are forwarded (signal handlers: main thread only)."""
    old = {}
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGINT, signal.SIGTERM):
        old[signum] = signal.signal(signum, self.forward)
    try:
      yield self
    finally:
      for signum, handler in old.items():
        signal.signal(signum, handler)
