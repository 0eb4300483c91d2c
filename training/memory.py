"""Memory before compiling: a run's estimated need (models.accounting) against the device's limit.

A model far too large for the device would otherwise fail inside XLA (RESOURCE_EXHAUSTED with a
traceback) or, on a CPU host, be killed by the kernel. `check_training_memory` refuses it in one
line before anything is allocated; `out_of_memory_line` reports an XLA RESOURCE_EXHAUSTED that gets
past the estimate (which leaves XLA's temporaries out) in one line too.
"""

import math
import os
import resource

import jax

from layers import options
from layers import sharding
from models import accounting

GIB = 2 ** 30


class OutOfMemory(options.ConfigError):
  """The estimated training memory exceeds what the device (or the host, on a CPU) has."""


def _meminfo(key, path='/proc/meminfo'):
  """A /proc/meminfo-style field in bytes (its values are in kB), or None."""
  try:
    with open(path) as f:
      for line in f:
        name, _, value = line.partition(':')
        if name == key:
          return int(value.split()[0]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def _read_int(path):
  try:
    with open(path) as f:
      text = f.read().strip()
  except OSError:
    return None
  return int(text) if text.isdigit() else None  # cgroup v2 writes 'max' for no limit


def host_limit():
  """(bytes, what) this process may still allocate on the host: the least of the kernel's
  MemAvailable, the room left under the cgroup's memory limit (v2 or v1), and the address space
  left under RLIMIT_AS (`ulimit -v`)."""
  found = []
  available = _meminfo('MemAvailable')
  if available is None and hasattr(os, 'sysconf'):
    try:
      available = os.sysconf('SC_AVPHYS_PAGES') * os.sysconf('SC_PAGE_SIZE')
    except (ValueError, OSError):
      available = None
  if available is not None:
    found.append((available, 'available host memory'))
  for limit_path, usage_path in (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                                 ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                                  '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
    limit, usage = _read_int(limit_path), _read_int(usage_path)
    if limit is not None and limit < 2 ** 60:  # v1 writes a huge number for no limit
      found.append((max(limit - (usage or 0), 0), 'room under the cgroup memory limit'))
      break
  soft, _ = resource.getrlimit(resource.RLIMIT_AS)
  if soft != resource.RLIM_INFINITY:
    used = _meminfo('VmSize', '/proc/self/status') or 0
    found.append((max(soft - used, 0), f'address space left under RLIMIT_AS={soft / GIB:.1f} GiB'))
  return min(found) if found else (None, 'unknown')


def device_limit(device=None):
  """(bytes, what) one device may hold: the accelerator allocator's `bytes_limit`, or on a CPU
  (whose `memory_stats()` is None) the host's `host_limit`."""
  device = device or jax.local_devices()[0]
  stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit']), f'{device.platform} device memory ({device.device_kind})'
  return host_limit()


def mesh_devices(config):
  """How many devices the run's mesh uses (all mesh sizes 1: one device)."""
  mesh = config.get('mesh', None) or {}
  return math.prod(int(mesh.get(a, 1)) for a in sharding.MESH_AXES)


def estimate(config, vocab_size):
  """`models.accounting.training_bytes` of a resolved, validated config."""
  return accounting.training_bytes(config.model, vocab_size, config.train.batch_size,
                                   config.data.max_length, config.get('mesh', None) or {},
                                   config.train.get('grad_accum_steps', 1))


def describe(need, limit, what, devices=1):
  """The one-line comparison both reports share: the estimate, its parts, and the limit."""
  shared = f' x {devices} devices sharing the host' if devices > 1 else ''
  limit_text = 'unknown' if limit is None else f'{limit / GIB:.1f} GiB'
  return (f'estimated training memory {need["total"] / GIB:.1f} GiB per device{shared} '
          f'(models.accounting: parameters, gradients and AdamW moments '
          f'{need["state"] / GIB:.1f} GiB, activations {need["activations"] / GIB:.1f} GiB); '
          f'limit {limit_text} ({what})')


_ADVICE = ('make it smaller (model.d_model, model.num_layers, model.d_ff, train.batch_size), '
           'raise train.grad_accum_steps, or shard it over more devices (mesh.fsdp, mesh.tensor)')


def check_training_memory(config, vocab_size, limit=None):
  """Raises OutOfMemory when the estimate exceeds the device's memory; returns (estimate, limit,
  what) for the report of a later out-of-memory error.

  On a CPU every device of the mesh is carved out of the same host memory, so the estimate is
  multiplied by the devices this process drives before it is compared with the host's limit.

  Args:
    config: a resolved, validated config.
    vocab_size: the tokenizer's vocabulary size.
    limit: (bytes, what) instead of `device_limit()` (tests).
  """
  need = estimate(config, vocab_size)
  limit, what = limit or device_limit()
  devices = 1
  if jax.local_devices()[0].platform == 'cpu':
    devices = max(1, mesh_devices(config) // jax.process_count())
  if limit is not None and need['total'] * devices > limit:
    raise OutOfMemory(f'out of memory: {describe(need, limit, what, devices)}; {_ADVICE}')
  return need, limit, what


def is_out_of_memory(error):
  """Whether `error` is XLA's RESOURCE_EXHAUSTED (or Python's MemoryError)."""
  return isinstance(error, MemoryError) or 'RESOURCE_EXHAUSTED' in str(error)


def out_of_memory_line(error, config, vocab_size, limit=None):
  """One line for an out-of-memory error during the run: XLA's own first line (what it failed to
  allocate), then the run's estimate and the device's limit (`limit`, as measured before the run
  began; default: now), as `check_training_memory` words them.
  """
  first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
  try:
    limit, what = limit or device_limit()
    context = f'; {describe(estimate(config, vocab_size), limit, what)}'
  except Exception:  # noqa: BLE001
    context = ''
  return f'train: out of memory: {first}{context}; {_ADVICE}'
