"""Host tuning before JAX starts: glibc malloc settings for XLA:CPU's per-step temporaries."""

import ctypes
import glob
import importlib.metadata
import importlib.util
import os
import signal

from absl import flags


def exit_at_once_on_signals(program, note='before training began; nothing was saved'):
  """Until the training loop installs its own handlers (which save a checkpoint, then stop),
  SIGINT and SIGTERM end the process at once with one line and status 128 + the signal's number:
  nothing is saved yet, so nothing is lost, and no interpreter shutdown runs while XLA compiles
  (a KeyboardInterrupt traceback, once a segfault). Call it first thing."""
  def stop(signum, frame):
    del frame
    os.write(2, f'{program}: stopped by {signal.Signals(signum).name} {note}; rerun the same '
                'command\n'.encode())
    os._exit(128 + signum)
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, stop)


# Set by a parent that starts train.py or eval.py as a child it must take along when it dies
# (tools.sweep's runner): '<signal number>:<parent pid>'.
PARENT_DEATH_SIGNAL = 'ATTNLAB_PARENT_DEATH_SIGNAL'


def parent_death_env(signum):
  """The environment entry that makes the child `die_with_parent(signum)`."""
  return {PARENT_DEATH_SIGNAL: f'{int(signum)}:{os.getpid()}'}


def die_with_parent():
  """In a child started with `parent_death_env`: the signal it names arrives when the parent's
  thread that started this process dies, however it dies (SIGKILL included; Linux's
  PR_SET_PDEATHSIG, elsewhere nothing). Set here, after exec, rather than in a `preexec_fn`: a
  preexec_fn runs Python between fork and exec in a copy of a multithreaded parent (JAX's
  threads), where a lock held by another thread deadlocks it, and JAX warns of exactly that on
  every cell. A parent already gone (the race before this call) sends the signal at once. Call it
  first thing."""
  entry = os.environ.pop(PARENT_DEATH_SIGNAL, None)
  if not entry:
    return
  signum, parent = (int(x) for x in entry.split(':'))
  try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG = 1
  except (OSError, AttributeError):
    return
  if os.getppid() != parent:
    os.kill(os.getpid(), signum)


def define_host_malloc_flag():
  """--host_malloc, shared by train.py and eval.py."""
  flags.DEFINE_enum('host_malloc', 'auto', ['auto', 'on', 'off'], 'Tune glibc malloc before JAX '
                    'starts (`tune_host_malloc`): auto = when no GPU/TPU plugin is installed.')


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def tune_host_malloc():
  """One glibc malloc arena, no mmap for large blocks, no trimming; returns whether it applied.

  XLA:CPU allocates each step's temporaries afresh; under glibc's defaults every large one is a new
  mmap, page-faulted in and unmapped again (about 1 GB per step of the (a) benchmark model). With
  these settings the heap keeps and reuses them: benchmarks/train_throughput.py measured +10%
  tokens/s on (a) and +21% on (b) (benchmarks/README.md). The arena limit only holds for threads
  started afterwards,
  so call it before the first JAX call. Freed host memory stays with the process (its peak is
  unchanged). A no-op where libc is not glibc.
  """
  try:
    libc = ctypes.CDLL('libc.so.6')
  except OSError:
    return False
  done = [libc.mallopt(param, value) == 1 for param, value in (
      (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2 ** 31 - 1))]
  return all(done)


# Device nodes of an accelerator: NVIDIA GPUs, AMD GPUs (kfd), TPU v4/v5p (accel), TPU v5e/v6e
# (vfio), a GPU under WSL2 (dxg).
ACCELERATOR_DEVICES = ('/dev/nvidia[0-9]*', '/dev/kfd', '/dev/accel[0-9]*', '/dev/vfio/[0-9]*',
                       '/dev/dxg')
# Set by `cpu_when_no_accelerator` when it chose the CPU (the user did not).
_CHOSE_CPU = []


def accelerator_devices():
  """Whether this host has a GPU or TPU device node (looked up without starting JAX)."""
  return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def cpu_when_no_accelerator():
  """On a host without an accelerator device, JAX_PLATFORMS=cpu unless it is set: an installed
  libtpu (the test extra's, for ahead-of-time compiles) would otherwise probe for a TPU at every
  start and print five lines of errors. Call it before JAX starts."""
  if 'JAX_PLATFORMS' not in os.environ and not accelerator_devices():
    os.environ['JAX_PLATFORMS'] = 'cpu'
    _CHOSE_CPU.append(True)


def cpu_notice(program):
  """The one line a program prints once when `cpu_when_no_accelerator` chose the CPU (None when
  the user set JAX_PLATFORMS or a device node was found): a GPU reachable some other way would
  otherwise train on the CPU without a word."""
  if not _CHOSE_CPU:
    return None
  return (f'{program}: running on the CPU (no device node {", ".join(ACCELERATOR_DEVICES)}); '
          'set JAX_PLATFORMS (e.g. cuda or tpu) to choose the backend yourself')


def accelerator_plugin_installed():
  """Whether JAX will run on a GPU/TPU here: a backend for one is installed (looked up without
  starting JAX) and the host has its device. libtpu alone (the test extra installs it to compile
  for TPUs) does not make a CPU host an accelerator host."""
  if os.environ.get('JAX_PLATFORMS', '').strip().lower() == 'cpu':
    return False
  plugins = importlib.metadata.entry_points(group='jax_plugins')
  installed = bool(plugins) or importlib.util.find_spec('libtpu') is not None
  return installed and accelerator_devices()


def host_malloc_wanted(flag):
  """--host_malloc: 'auto' tunes malloc on CPU-only hosts (where it was measured), 'on'/'off'."""
  return flag == 'on' or (flag == 'auto' and not accelerator_plugin_installed())

