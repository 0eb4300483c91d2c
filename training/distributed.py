"""Several processes and devices: joining a run, the mesh, placing batches, gathering results.

Every collective here must be called by all processes of the run; with one process each is a
no-op that returns its input.
"""

import json
import os
import re

from absl import flags
import jax
from jax.experimental import multihost_utils
import numpy as np

from layers import options
from layers import sharding
from training import supervisor

def define_distributed_flags():
  """Multi-host flags of train.py and eval.py: the arguments of `jax.distributed.initialize`."""
  flags.DEFINE_string('coordinator_address', None, 'Multi-process: host:port of process 0 '
                      '(none of the three flags: auto-detected on TPU pods and SLURM, else one '
                      'process).')
  flags.DEFINE_integer('num_processes', None, 'Multi-process: the number of processes.')
  flags.DEFINE_integer('process_id', None, 'Multi-process: this process\'s index.')
  flags.DEFINE_bool('multihost', False, 'Join a multi-process run found by JAX\'s auto-detection '
                    '(TPU pod slices, SLURM, Open MPI) even if no cluster variable is seen.')
  flags.DEFINE_integer('heartbeat_timeout', supervisor.HEARTBEAT_TIMEOUT, 'Multi-process: '
                       'seconds without a heartbeat after which a process counts as lost and the '
                       'others stop (JAX\'s heartbeat_timeout_seconds).', lower_bound=1)
  flags.DEFINE_integer('init_timeout', supervisor.INIT_TIMEOUT, 'Multi-process: seconds to wait '
                       'for every process to join (JAX\'s initialization_timeout).', lower_bound=1)

CLUSTER_ENV = supervisor.CLUSTER_ENV

def init_distributed(coordinator_address=None, num_processes=None, process_id=None,
                     multihost=False, heartbeat_timeout=None, init_timeout=None):
  """Joins a multi-process run before any other JAX call; returns the process count.

  Explicit arguments join that run (on CPU over gloo collectives, e.g. local processes on
  loopback); with none, a cluster JAX can detect (SLURM, Open MPI, GKE TPU variables in
  `CLUSTER_ENV`, or any with `multihost`, e.g. a Cloud TPU VM slice) is joined with
  auto-detection, and anything else is a single process. `heartbeat_timeout` and `init_timeout`
  (seconds; None: JAX's defaults, 100 and 300) bound the wait for a lost process and for the
  others to join (training.supervisor reports either in one line).
  """
  explicit = any(v is not None for v in (coordinator_address, num_processes, process_id))
  multi = explicit or multihost or any(os.environ.get(k, '1') not in ('', '1') for k in CLUSTER_ENV)
  if multi:
    # CPU devices need a collectives backend to talk across processes (ignored on GPU/TPU).
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    timeouts = {k: v for k, v in (('heartbeat_timeout_seconds', heartbeat_timeout),
                                  ('initialization_timeout', init_timeout)) if v is not None}
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
    supervisor.note_joined()
  return jax.process_count()

# What a failed collective or save says when another process went away (gloo's broken connection,
# a barrier or key of the coordination service that failed).
_LOST_PEER = re.compile(r'Gloo|gloo|Connection reset|Connection closed|coordination service|'
                        r'CoordinationService|heartbeat|[Bb]arrier|UNAVAILABLE|DEADLINE_EXCEEDED')


def lost_peer(error):
  """Whether `error` of a multi-process run says that another process went away."""
  return jax.process_count() > 1 and bool(_LOST_PEER.search(str(error)))

def make_mesh(config):
  """The device mesh of `config.mesh` (all sizes 1: the first device), or a ConfigError."""
  try:
    return sharding.make_mesh(config.get('mesh', {}))
  except ValueError as e:
    raise options.ConfigError(str(e)) from None

def place_batch(batch, mesh, rules, first_row=0, batch_size=None):
  """A host batch as global arrays on `mesh`: rows over the batch axes, the length over `sequence`
  (layers.sharding rules); each process fills only the shards its devices hold.

  `batch` holds rows `first_row`, ... of a global batch of `batch_size` rows (default: it is the
  whole batch): with `data.shards`, a process reads only the rows its devices hold.
  """
  def put(x):
    x = np.asarray(x)
    shape = (batch_size or len(x),) + x.shape[1:]
    names = ('batch', 'length') + (None,) * (x.ndim - 2)
    spec = sharding.spec(names[:x.ndim], shape, mesh, rules)

    def local(index):
      start, stop, _ = index[0].indices(shape[0])
      return x[(slice(start - first_row, stop - first_row),) + tuple(index[1:])]
    return jax.make_array_from_callback(shape, jax.sharding.NamedSharding(mesh, spec), local)
  return jax.tree.map(put, batch)

def process_rows(mesh, rules, batch_size, length, devices=None):
  """(start, stop): the span of rows of a `[batch_size, length]` global batch that `devices`
  (default: this process's) hold."""
  spec = sharding.spec(('batch', 'length'), (batch_size, length), mesh, rules)
  indices = jax.sharding.NamedSharding(mesh, spec).devices_indices_map((batch_size, length))
  devices = set(jax.local_devices() if devices is None else devices)
  rows = [index[0].indices(batch_size)[:2] for d, index in indices.items() if d in devices]
  return min(r[0] for r in rows), max(r[1] for r in rows)

def data_shards(config, mesh, rules, devices=None):
  """The `data.shards` a process reads: all of them in a single process; with several, those that
  cover the span of rows its devices (`devices`, default its own) hold: only its own where the
  batch axes split the rows into contiguous blocks per process (the usual layout), every one where
  the batch is replicated over processes."""
  num_shards, batch_size = config.data.get('shards', 1), config.train.batch_size
  if jax.process_count() == 1 and devices is None:
    return range(num_shards)
  start, stop = process_rows(mesh, rules, batch_size, config.data.max_length, devices)
  per = batch_size // num_shards
  return range(start // per, -(-stop // per))

def allgather_ragged(x):
  """Every process's array `x`, whose leading axis may differ in length between processes, as a
  list in process order (a collective: all must call; `[x]` with one process)."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return [x]
  sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(x))))
  padded = np.zeros((int(sizes.max()),) + x.shape[1:], x.dtype)
  padded[:len(x)] = x
  every = np.asarray(multihost_utils.process_allgather(padded))  # [P, longest, ...]
  return [block[:n] for block, n in zip(every, sizes)]

def allgather_json(obj):
  """Every process's JSON-serialisable `obj`, in process order (a collective: all must call)."""
  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  return [json.loads(block.tobytes()) for block in allgather_ragged(data)]

def global_batch(batch, first_row, batch_size):
  """The whole global batch from the processes' row blocks (a collective; for the diagnostics
  pass, at log steps only)."""
  if jax.process_count() == 1:
    return batch
  starts = [int(b[0]) for b in allgather_ragged(np.int32([first_row]))]
  out = {}
  for k, x in batch.items():
    full = np.zeros((batch_size,) + np.shape(x)[1:], np.asarray(x).dtype)
    for start, block in zip(starts, allgather_ragged(x)):
      full[start:start + len(block)] = block  # blocks of processes reading the same rows agree
    out[k] = full
  return out

# --- Evaluation shares: every process evaluates its part; the parts are gathered in order. ------

def process_share(n, align=1):
  """(start, stop): this process's contiguous share of `n` items (all of them in one process),
  cut at multiples of `align`."""
  per = -(-n // (align * jax.process_count())) * align
  return min(n, jax.process_index() * per), min(n, (jax.process_index() + 1) * per)

def gather_rows(rows):
  """Every process's `rows` (an array whose leading axis is its share), concatenated in process
  order; `rows` itself in a single-process run."""
  return np.concatenate(allgather_ragged(rows))

def gather_token_lists(lists):
  """`gather_rows` for lists of token ids of any lengths."""
  if jax.process_count() == 1:
    return lists
  lengths = gather_rows(np.int32([len(x) for x in lists]))
  tokens = gather_rows(np.int32([t for x in lists for t in x]))
  if not len(lengths):
    return []
  return [x.tolist() for x in np.split(tokens, np.cumsum(lengths)[:-1])]

def gather_sums(sums):
  """Summed metrics added over the processes."""
  if jax.process_count() == 1:
    return sums
  return {k: np.sum(multihost_utils.process_allgather(np.float64(v))) for k, v in sums.items()}
