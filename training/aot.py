"""Ahead-of-time compilation for a TPU topology this host does not have (libtpu, compile only).

libtpu describes any TPU slice by name (`jax.experimental.topologies.get_topology_desc`, e.g.
'v5p:4x4x4') as compile-only devices; a program lowered for platform 'tpu' over a mesh of them is
compiled by libtpu's real compiler, Mosaic kernels included, on a CPU host (as MaxText's
train_compile.py does). `compile_config` builds a config's training state abstractly (no device
memory), sharded by its mesh and rules, compiles the train step, the eval step and the cached
decode step, and reads each program's per-chip memory, FLOPs, collectives and custom calls.

The attention kernel follows the lowering platform (`lax.platform_dependent`): the programs hold
the TPU kernels whatever the host. GPUs go the same way where jax's CUDA plugin is installed: XLA's
description of an H100 (training/targets/) gives N compile-only GPUs ('h100:8'), and the programs
hold the Triton kernels.
"""

import collections
import contextlib
import functools
import os
import pathlib
import re

import jax
import jax.numpy as jnp

from data import pipeline
from layers import attention
from layers import sharding
import models
from training import diagnostics
from training import hlo_cost
from training import roofline
from training import loop
from training import state as state_lib
from training import steps
from training import validation_attention

GiB = 2 ** 30
# The chips by the `device_kind` their compile-only devices report: their generation, whose
# published figures (HBM, peak FLOP/s, bandwidths, with sources) are training.roofline.PEAKS. A
# program also needs what the runtime keeps for itself (libtpu lets a program use 15.75 of v5e's
# 16 GiB), so a total within a few percent of the HBM is marginal.
CHIPS = {kind: (gen, roofline.PEAKS[gen]['hbm']) for kind, gen in {
    'TPU v4': 'v4', 'TPU v5 lite': 'v5e', 'TPU v5': 'v5p', 'TPU v6 lite': 'v6e',
    'NVIDIA H100 80GB HBM3': 'h100'}.items()}
# GPU kinds by XLA's target description (training/targets/), for '--topology=KIND:N'.
GPU_TARGETS = {'h100': 'h100_sxm.txtpb'}
EXAMPLE_TOPOLOGIES = ('v4:2x2x1', 'v5e:2x2', 'v5p:2x2x2', 'v5p:4x4x4', 'v6e:2x2')
COLLECTIVES = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')
# The custom-call target of the Pallas kernels, by lowering platform (Mosaic, Triton).
KERNEL_CALLS = {'tpu': 'tpu_custom_call', 'cuda': '__gpu$xla.gpu.triton'}


class AotError(Exception):
  """A topology, mesh or environment the compile cannot start from (one line; exit 2)."""


def quiet_libtpu():
  """Environment for compiling on this host: libtpu's start-up noise ("could not determine TPU
  accelerator type", INVALID_ARGUMENT on TPU_WORKER_HOSTNAMES) kept out, no GPU autotuning. Call
  it before jax starts."""
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # this host's programs run on its CPU
  if not jax.config.jax_platforms:  # jax was imported first (it reads the variable on import);
    # set, it also makes jax register the CUDA plugin's compile-only topologies
    jax.config.update('jax_platforms', os.environ['JAX_PLATFORMS'])
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')  # no metadata server to ask
  # Compile-only: several processes (a test run's workers, a sweep) may hold libtpu at once.
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  # GPU targets: XLA would otherwise time candidate kernels on a GPU this host does not have.
  if '--xla_gpu_autotune_level' not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               ' --xla_gpu_autotune_level=0').strip()


@contextlib.contextmanager
def _libtpu_host_env():
  """While libtpu starts: without these it looks for a TPU of its own and logs that it found none.
  They name no target (the topology passed to get_topology_desc does), and they are removed
  again: TPU_WORKER_HOSTNAMES in a process's environment means a TPU pod to train.py's cluster
  detection (training.distributed), which every subprocess would inherit."""
  env = {'TPU_ACCELERATOR_TYPE': 'v5p-8', 'TPU_WORKER_HOSTNAMES': 'localhost'}
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update({k: v for k, v in env.items() if saved[k] is None})
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)


def topology_devices(name):
  """The compile-only devices of TPU topology `name` (e.g. 'v5p:2x2x2'), or of N GPUs of a kind
  in `GPU_TARGETS` ('h100:8', through jax's CUDA plugin).

  Raises:
    AotError: libtpu (or the CUDA plugin) is not installed, or `name` is unknown (one line, with
      examples).
  """
  from jax.experimental import topologies
  kind, _, count = name.partition(':')
  if kind in GPU_TARGETS:
    return _gpu_devices(topologies, kind, count)
  try:
    import libtpu  # noqa: F401
  except ImportError:
    raise AotError('libtpu is not installed; install it into this virtualenv with: '
                   f'.venv/bin/pip install "jax[tpu]=={jax.__version__}"') from None
  try:
    with _libtpu_host_env():
      return topologies.get_topology_desc(topology_name=name, platform='tpu').devices
  except Exception as e:  # libtpu raises XlaRuntimeError / ValueError with long texts  # noqa: BLE001
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    if 'INVALID_ARGUMENT' not in first:
      raise AotError(f'libtpu could not describe --topology={name!r}: {first}') from None
    raise AotError(f'--topology={name!r} is not a TPU topology libtpu knows ({first}); valid '
                   f'examples: {", ".join(EXAMPLE_TOPOLOGIES)}, or '
                   f'{", ".join(k + ":8" for k in GPU_TARGETS)}') from None


def _gpu_devices(topologies, kind, count):
  """N compile-only GPUs described by XLA's target file for `kind` (autotuning off: no GPU)."""
  if not count.isdigit() or int(count) < 1:
    raise AotError(f'--topology={kind}:{count}: the GPU count must be a positive integer, e.g. '
                   f'{kind}:8')
  try:
    import jax_cuda12_plugin  # noqa: F401
  except ImportError:
    raise AotError(f'--topology={kind}:{count} needs jax\'s CUDA plugin; install it into a '
                   'virtualenv of its own (it prints a line on every JAX start-up without a GPU): '
                   f'pip install "jax-cuda12-plugin=={jax.__version__}"') from None
  text = (pathlib.Path(__file__).parent / 'targets' / GPU_TARGETS[kind]).read_text()
  try:
    return topologies.get_topology_desc(platform='cuda', target_config=text,
                                        topology=f'1x1x{count}').devices
  except Exception as e:  # noqa: BLE001
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    raise AotError(f'jax could not describe --topology={kind}:{count}: {first}') from None


def lowering_platform(device):
  """The platform to lower for: a device's own, but 'cuda' for 'gpu' (a compile-only GPU device
  says 'gpu', which jax resolves only against a running GPU backend)."""
  return {'gpu': 'cuda'}.get(device.platform, device.platform)


def target_generation(device):
  """The chip generation a report names ('v5e', 'h100'; the device kind if `CHIPS` lacks it)."""
  return CHIPS.get(device.device_kind, (device.device_kind,))[0]


def hbm_bytes(device):
  """The HBM of one chip (`CHIPS`), or None for a kind the table lacks."""
  return CHIPS.get(device.device_kind, (None, None))[1]


def auto_mesh(config, num_devices):
  """`config` with every mesh axis 1 but fsdp = `num_devices` (`--mesh=auto`)."""
  config = config.copy_and_resolve_references()
  for axis in sharding.MESH_AXES:
    config.mesh[axis] = num_devices if axis == 'fsdp' else 1
  return config


def make_mesh(config, devices):
  """The config's mesh over `devices`, or an AotError naming the sizes and the chip count."""
  try:
    return sharding.make_mesh(config.get('mesh', {}), devices)
  except ValueError as e:
    raise AotError(f'{e} (the chips of the topology)') from None


def _abstract_batch(config, mesh, rules, batch_size):
  shapes = pipeline.batch_shapes(models.batch_format(config.model.arch), batch_size,
                                 config.data.max_length)
  def sds(shape, dtype):
    spec = sharding.spec(('batch', 'length'), shape, mesh, rules)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
  return {name: sds(*v) for name, v in shapes.items()}


def hlo_counts(text):
  """(collectives {op: count}, custom calls {target: count}) in a compiled program's HLO text.

  These count instructions in the program, not executions (a scanned body's count once). An
  asynchronous collective (`all-gather-start` ... `-done`) counts once; every kind of
  `COLLECTIVES` is present (0 when absent).
  """
  collectives = {op: 0 for op in COLLECTIVES}
  # The opcode follows the result's shape (a tuple's ends in ')'); `-done` halves do not match.
  for op in re.findall(r'[ )](' + '|'.join(COLLECTIVES) + r')(?:-start)?\(', text):
    collectives[op] += 1
  calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  return collectives, dict(sorted(calls.items()))


def analyse(compiled, devices=(), model_flops=None):
  """Per-chip figures of one compiled program: bytes (arguments, outputs, temporaries, aliased,
  total = arguments + outputs + temporaries - aliased), XLA's FLOPs with each loop body counted
  as many times as it runs (training.hlo_cost; None where the compiler gives none), XLA's own
  count with each body once (`flops_counted_once`), the loops ({body: runs per step}) and whether
  their bodies' costs were read (`loops_counted`), collectives, custom calls, and the roofline
  estimate (training.roofline, from the corrected FLOPs and bytes; None where the chip or the cost
  analysis is unknown) on `devices`, the mesh's devices in order, with `model_flops` per chip for
  its MFU."""
  mem = compiled.memory_analysis()
  sizes = {'argument': mem.argument_size_in_bytes, 'output': mem.output_size_in_bytes,
           'temp': mem.temp_size_in_bytes, 'alias': mem.alias_size_in_bytes}
  sizes = {k: int(v) for k, v in sizes.items()}
  sizes['total'] = sizes['argument'] + sizes['output'] + sizes['temp'] - sizes['alias']
  cost = compiled.cost_analysis()  # None for a compile-only GPU executable
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = compiled.as_text()
  cost, loops, counted = hlo_cost.loop_corrected(cost, text)
  flops = None if not cost or 'flops' not in cost else float(cost['flops'])
  collectives, calls = hlo_counts(text)
  estimate = None
  if devices:
    estimate = roofline.estimate(target_generation(devices[0]), cost, text, devices, model_flops)
  return {'bytes': sizes, 'flops': flops,
          'flops_counted_once': None if flops is None else float(
              cost.get('flops_counted_once', flops)),
          'loops': loops, 'loops_counted': counted,
          'collectives': collectives, 'custom_calls': calls, 'estimate': estimate}


def compile_config(config, devices, *, vocab_size, special_ids=None,
                   programs=('train', 'eval', 'decode')):
  """Compiles `config`'s steps for `devices` (compile-only TPU devices) on this host.

  Args:
    config: a resolved, validated config; its mesh's product must be the device count.
    devices: `topology_devices(...)` (or any compile-only devices: the programs are lowered for
      their platform).
    vocab_size: V of the configured task's tokenizer.
    special_ids: `models.SpecialIds` (encoder_only masks by them; they are constants of the
      program, so any tokenizer's serve to compile it).
    programs: which of 'train' (the loop's jitted `train_step`, state donated), 'eval'
      (`steps.eval_step`) and 'decode' (one cached `decode_step` of a batch: decoder-only and
      encoder-decoder models each of whose decoder layers declares a cached step) to compile.

  Returns:
    {program: `analyse(...)`} for each compiled program.
  """
  mesh = make_mesh(config, devices)
  rules = sharding.rules_of(config.get('mesh', {}))
  graphdef, tx, state = state_lib.abstract_state(config, vocab_size, mesh,
                                                 special_ids=special_ids)
  batch = _abstract_batch(config, mesh, rules, config.train.batch_size)
  out = {}

  def lower(fn, *args):
    with (jax.set_mesh(mesh), sharding.use_rules(mesh, rules),
          attention.compiling_for(devices[0].platform)):
      return fn.trace(*args).lower(lowering_platforms=(lowering_platform(devices[0]),)).compile()

  ordered = list(mesh.devices.flat)  # the programs' partitions, for their collectives' groups
  if 'train' in programs:
    leaf_groups = diagnostics.param_groups(state['params'])[1]
    out['train'] = analyse(lower(loop.jit_train_step(config, graphdef, tx, state, mesh,
                                                     leaf_groups), state, batch),
                           ordered, analytic_flops(config, vocab_size, len(devices), full=True))
  variables = state_lib.model_variables(state)
  if 'eval' in programs:
    out['eval'] = analyse(lower(jax.jit(functools.partial(steps.eval_step, graphdef)),
                                variables, batch), ordered)
  if 'decode' in programs and validation_attention.decodes_with_cache(config.model):
    out['decode'] = analyse(lower(*_decode_program(config, graphdef, variables, batch, mesh,
                                                   rules)), ordered)
  return out


def _decode_program(config, graphdef, variables, batch, mesh, rules):
  """(jitted one-token cached step, its abstract arguments): the cache of the batch's rows at the
  training length, one token per row. The cache is laid out by the rules (rows over the batch
  axes, KV heads over theirs) and kept in that layout, so the donated cache is updated in place."""
  b, length = config.train.batch_size, config.data.max_length

  def init(variables, batch):
    return state_lib.merge(graphdef, variables).init_cache(batch, length)

  def step(variables, cache, tokens, index):
    return state_lib.merge(graphdef, variables).decode_step(cache, tokens, index)

  def layout(x):  # k/v [B, S, K, H]; a mask or block table [B, S]; anything else replicated
    names = {4: ('batch', None, 'kv_heads', 'head_dim'), 2: ('batch', None), 1: ('batch',)}
    if x.ndim not in names or x.shape[0] != b:
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.sharding.NamedSharding(mesh, sharding.spec(names[x.ndim], x.shape, mesh, rules))

  with jax.set_mesh(mesh):
    cache = jax.eval_shape(init, variables, batch)
  cache_sharding = jax.tree.map(layout, cache)
  cache = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), cache,
                       cache_sharding)
  rows = jax.sharding.NamedSharding(mesh, sharding.spec(('batch',), (b,), mesh, rules))
  tokens = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows)
  fn = jax.jit(step, donate_argnums=(1,), out_shardings=(None, cache_sharding))
  return fn, variables, cache, tokens, tokens


def per_chip_bytes(report):
  """The largest per-chip total of a `compile_config` report's programs: what the chip must hold
  (the programs run one at a time; each holds the state as its arguments)."""
  return max(r['bytes']['total'] for r in report.values())


def analytic_flops(config, vocab_size, chips, platform='tpu', *, full=False):
  """`models.accounting`'s FLOPs of one training step per chip, counted for the configured kernel
  lowered for `platform`: 3x the forward matmuls (forward and backward), and the score matrices'
  T x S x H products as many times as the kernel computes them (`Kernel.score_matmuls`) over the
  tiles it visits (`Kernel.tiles`: a kernel that skips the tiles outside the causal band), or the
  full matrices; `full=True`: every layer's full score matrices x3 (what the count was before
  kernels declared theirs). None for an arch the closed forms do not cover (no Transformer
  stacks: rnn_seq2seq)."""
  from models import accounting
  if config.model.arch not in models.ARCHS or not accounting.covers(config.model.arch):
    return None
  kernel = attention.KERNELS[config.model.attention_impl]
  tiles = None if full else dict(kernel.tiles).get(platform)
  row = accounting.forward_flops(config.model, vocab_size, config.data.max_length, tiles=tiles)
  if full:
    step = 3.0 * (row['matmul'] + row['scores'])
  else:  # 'scores' counts 2 products (QKᵀ, PV) of the forward
    step = 3.0 * row['matmul'] + row.get('scores_tiled', row['scores']) * kernel.score_matmuls / 2
  return step * config.train.batch_size / chips


def target(config, devices):
  """What a report says of the target: the chips' kind and generation, their count and HBM, and
  the mesh sizes."""
  hbm = hbm_bytes(devices[0])
  return {'topology_kind': devices[0].device_kind,
          'generation': target_generation(devices[0]),
          'chips': len(devices), 'hbm_bytes': None if hbm is None else int(hbm),
          'mesh': {a: int(config.mesh.get(a, 1)) for a in sharding.MESH_AXES}}


def param_count(config, vocab_size):
  """The model's parameters (`models.accounting`, counted on the abstract model)."""
  from models import accounting
  model = accounting.abstract_model(config.model, vocab_size, config.data.max_length)
  return int(sum(accounting.counted_params(model).values()))


def summary(config, devices, report, vocab_size):
  """The JSON summary of a compile: fits, bytes, chips, mesh, collectives, custom calls, FLOPs."""
  hbm = hbm_bytes(devices[0])
  need = per_chip_bytes(report)
  train = report.get('train', next(iter(report.values())))
  kernels = collections.Counter()
  for r in report.values():
    kernels.update(r['custom_calls'])
  return {
      **target(config, devices),
      'fits': None if hbm is None else need <= hbm,  # None: the chip's HBM is not in CHIPS
      'per_chip_bytes': int(need),
      'params': param_count(config, vocab_size),
      'flops_per_chip': train['flops'],
      'flops_counted_once_per_chip': train.get('flops_counted_once'),
      'loops': train.get('loops', {}),
      'loops_counted': train.get('loops_counted', True),
      'analytic_flops_per_chip': analytic_flops(config, vocab_size, len(devices),
                                                lowering_platform(devices[0])),
      'analytic_flops_full_per_chip': analytic_flops(config, vocab_size, len(devices),
                                                     full=True),
      'collectives': train['collectives'],
      'estimate': train.get('estimate'),
      'custom_calls': dict(sorted(kernels.items())),
      'programs': report,
  }

