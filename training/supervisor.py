"""A multi-process run's lost process, reported in one line by a small parent process per host.

When a process of a run dies (a preempted or dead VM), JAX's coordination service ends every other
one with a C++ abort (SIGABRT, a `Check failure stack trace`, a thread dump); when process 0, the
coordinator, dies they abort at once. No Python code runs in between, so `supervise` runs the
program as a child of a parent that imports nothing heavy: the child's native output (XLA's logs,
the abort's trace, faulthandler's dumps) goes to WORKDIR/logs/process-N.log, its Python output to
the terminal as before; when the child ends by the coordination service's abort, the parent prints
one line naming the lost process, the last confirmed checkpoint and the command to rerun, and
exits `LOST_PROCESS_EXIT`. JAX's own timeouts bound the wait (`--heartbeat_timeout`,
`--init_timeout`: `jax.distributed.initialize`'s `heartbeat_timeout_seconds` and
`initialization_timeout`).
"""

import ctypes
import faulthandler
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback

# The exit status of a run that lost a process or whose processes did not all join (sysexits.h's
# EX_TEMPFAIL, "try again later"): the same command on every host resumes it.
LOST_PROCESS_EXIT = 75
HEARTBEAT_TIMEOUT = 60  # s, --heartbeat_timeout's default: short enough for a pod
INIT_TIMEOUT = 300  # s, --init_timeout's default (JAX's own): VMs of a pod may start minutes apart
# Cluster variables under which JAX's auto-detection joins a multi-process run.
CLUSTER_ENV = ('SLURM_STEP_NUM_TASKS', 'TPU_WORKER_HOSTNAMES', 'MEGASCALE_COORDINATOR_ADDRESS',
               'OMPI_COMM_WORLD_SIZE')
_LOG, _STATUS = 'ATTNLAB_PROCESS_LOG', 'ATTNLAB_PROCESS_STATUS'  # set in the child only
_PR_SET_PDEATHSIG = 1
# What the coordination service's client logs as it ends a process (XLA's client.h).
_FATAL = 'Terminating process because the JAX distributed service detected fatal errors'


def flag_value(argv, name, default=None):
  """The last value of `--name=V` or `--name V` in `argv` (as absl reads it), else `default`."""
  value = default
  for i, arg in enumerate(argv):
    if arg in (f'--{name}', f'-{name}') and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith((f'--{name}=', f'-{name}=')):
      value = arg.split('=', 1)[1]
  return value


def multi_process(argv, environ):
  """Whether `argv` and `environ` ask for a multi-process run (training.distributed's test)."""
  explicit = any(flag_value(argv, n) is not None
                 for n in ('coordinator_address', 'num_processes', 'process_id'))
  multihost = any(a.lower() in ('--multihost', '-multihost', '--multihost=true', '--multihost=1')
                  for a in argv)
  return explicit or multihost or any(environ.get(k, '1') not in ('', '1') for k in CLUSTER_ENV)


def log_path(argv):
  """WORKDIR/logs/process-N.log (a gs:// or unusable workdir: under the temporary directory)."""
  workdir, name = flag_value(argv, 'workdir'), f'process-{flag_value(argv, "process_id", "0")}'
  if workdir and '://' not in workdir:
    try:
      os.makedirs(os.path.join(workdir, 'logs'), exist_ok=True)
      return os.path.join(workdir, 'logs', f'{name}.log')
    except OSError:
      pass
  directory = os.path.join(tempfile.gettempdir(), f'attnlab-logs-{os.getpid()}')
  os.makedirs(directory, exist_ok=True)
  return os.path.join(directory, f'{name}.log')


def _die_with_parent():
  """In the child before exec: SIGKILL when the parent dies (a SIGKILLed host takes it along)."""
  try:
    ctypes.CDLL('libc.so.6').prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except OSError:
    pass


def supervise(program):
  """In a multi-process run, runs this command again as a child and reports its loss (see the
  module docstring); returns at once in the child and in a single-process run. Call it first
  thing, before JAX is imported."""
  if _LOG in os.environ or not multi_process(sys.argv, os.environ):
    return
  log = log_path(sys.argv)
  start = os.path.getsize(log) if os.path.exists(log) else 0
  status = log + '.status'
  with open(status, 'w'):
    pass  # nothing joined, nothing saved yet
  child = subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, _LOG: log,
                                                             _STATUS: status},
                           preexec_fn=_die_with_parent)
  for signum in (signal.SIGTERM, signal.SIGINT):  # a preemption notice is the child's to handle
    signal.signal(signum, lambda s, frame: child.send_signal(s))
  code = child.wait()
  ended, state = time.time(), _read_status(status, sys.argv)
  os.remove(status)
  with open(log, errors='replace') as f:
    f.seek(start)
    text = f.read()
  if code in (0, 1, 2, 128 + signal.SIGTERM, 128 + signal.SIGINT) and not (
      code == 1 and _FATAL in text):  # the child said what happened (a fatal log may exit 1)
    os._exit(code)
  line, code = report(program, sys.argv, text, state, code, log)
  print('\n' + line, file=sys.stderr, flush=True)  # a progress bar may have the line's start
  with open(log, 'a') as f:
    f.write(f'{time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ended))} {line}\n')
  os._exit(code)


def _read_status(path, argv):
  """{'joined': bool, 'good': the newest checkpoint step or None} of the child: the newest it
  confirmed, or in a local workdir the newest Orbax committed (renamed to its step number once
  every process wrote its part; the one in flight is confirmed only at the next save)."""
  try:
    with open(path) as f:
      words = f.read().split()
  except OSError:
    words = []
  good = [int(w.split('=')[1]) for w in words if w.startswith('checkpoint=')]
  workdir = flag_value(argv, 'workdir') or ''
  try:
    good += [int(n) for n in os.listdir(os.path.join(workdir, 'checkpoints')) if n.isdigit()]
  except OSError:  # none yet, or a gs:// workdir: the confirmed one
    pass
  return {'joined': 'joined' in words, 'good': max(good) if good else None}


def report(program, argv, text, status, code, log):
  """(the one line, the exit status) of a child that ended with `code` (negative: by that signal),
  from its native log `text` and its `status` (`_read_status`)."""
  address = flag_value(argv, 'coordinator_address', 'the auto-detected coordinator')
  count = flag_value(argv, 'num_processes', '?')
  rerun = f'rerun the same command on every host ({shlex.join(["python", *argv])})'
  details = f'details in {log}'
  if not status['joined']:
    wait = flag_value(argv, 'init_timeout', INIT_TIMEOUT)
    return (f'{program}: not every process of {count} joined the run at {address} within {wait} s '
            f'(--init_timeout); start the same command on every host; {details}',
            LOST_PROCESS_EXIT)
  good = status['good']
  saved = (f'the newest checkpoint is step {good}' if good is not None
           else 'no checkpoint was saved yet')
  heartbeats = re.search(r'stopped sending heartbeats\):\s*([\d\s,]+)', text) or re.search(
      r'Task (\d+) heartbeat timeout', text)
  if heartbeats:
    lost = ', '.join(heartbeats.group(1).replace(',', ' ').split())
    wait = flag_value(argv, 'heartbeat_timeout', HEARTBEAT_TIMEOUT)
    return (f'{program}: process {lost} of {count} was lost (no heartbeat for {wait} s, '
            f'--heartbeat_timeout); {saved}; {rerun}; {details}', LOST_PROCESS_EXIT)
  if re.search(r'leader task|coordination service|CoordinationService', text):
    return (f'{program}: process 0 of {count}, the coordinator at {address}, was lost (it stopped '
            f'answering); {saved}; {rerun}; {details}', LOST_PROCESS_EXIT)
  how = (f'ended by {signal.Signals(-code).name}' if code < 0 else f'ended with exit status {code}')
  return f'{program}: this process {how}; {saved}; {rerun}; {details}', (
      128 - code if code < 0 else code)


# --- In the child. ------------------------------------------------------------------------------

def route_native_output():
  """In a supervised child: fd 2 (XLA's C++ logs, an abort's trace) to the log file, Python's
  `sys.stderr` (the program's own lines, warnings, progress) to the terminal as before. Call it
  before JAX starts."""
  path = os.environ.get(_LOG)
  if not path:
    return
  terminal = os.dup(2)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(fd, 2)
  os.close(fd)
  sys.stderr = os.fdopen(terminal, 'w', buffering=1)


def quiet_fault_dumps():
  """faulthandler's dumps (absl's app.run enables it on the terminal) to the log file."""
  if os.environ.get(_LOG):
    faulthandler.enable(file=2, all_threads=True)


def _note(word):
  path = os.environ.get(_STATUS)
  if path:
    with open(path, 'a') as f:
      f.write(word + '\n')


def note_joined():
  """Tells the parent that every process joined (a later loss is not a failed start)."""
  _note('joined')


def note_checkpoint(step):
  """Tells the parent the newest confirmed checkpoint step (named if a process is lost)."""
  if step is not None:
    _note(f'checkpoint={step}')


def await_abort(error):
  """In a supervised child whose collective failed (a peer went away): the trace to the log file,
  then the wait for the coordination service's verdict, which ends this process (the parent says
  who was lost). Bounded by twice the heartbeat timeout; then the process exits on its own."""
  if not os.environ.get(_LOG):
    return
  os.write(2, ''.join(traceback.format_exception(error)).encode(errors='replace'))
  time.sleep(2 * int(flag_value(sys.argv, 'heartbeat_timeout', HEARTBEAT_TIMEOUT)) + 10)
  sys.stderr.flush()
  os._exit(LOST_PROCESS_EXIT)
