"""The sweep runner's cell processes, and the SIGINT/SIGTERM it forwards to them."""

import contextlib
import os
import shlex
import signal
import subprocess
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cells run from here


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
      proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
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
