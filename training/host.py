"""Host tuning before JAX starts: glibc malloc settings for XLA:CPU's per-step temporaries."""

import ctypes
import importlib.metadata
import importlib.util
import os

from absl import flags


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
  these settings the heap keeps and reuses them: benchmarks/train_throughput.py measured +10% tokens/s
  on (a) and +21% on (b) (benchmarks/README.md). The arena limit only holds for threads started afterwards,
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


def accelerator_plugin_installed():
  """Whether a GPU/TPU backend for JAX is installed (looked up without starting JAX)."""
  if os.environ.get('JAX_PLATFORMS', '').strip().lower() == 'cpu':
    return False
  plugins = importlib.metadata.entry_points(group='jax_plugins')
  return bool(plugins) or importlib.util.find_spec('libtpu') is not None


def host_malloc_wanted(flag):
  """--host_malloc: 'auto' tunes malloc on CPU-only hosts (where it was measured), 'on'/'off'."""
  return flag == 'on' or (flag == 'auto' and not accelerator_plugin_installed())

