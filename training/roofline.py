"""A roofline estimate of one compiled step per chip: compute, memory and collective time.

An estimate from the compiled program, not a measurement. It reads what the compiler reports of
the program it built for the target (`compiled.cost_analysis()`: FLOPs and bytes accessed; the HLO
text: every collective, its operand size and the devices of its groups) and divides each by the
published peak of the chip (`PEAKS`):

- compute time = FLOPs / peak bf16 FLOP/s (XLA's default matmul precision runs float32 matmuls as
  bf16 passes on TPU, so the bf16 peak serves both dtypes);
- memory time = bytes accessed / HBM bandwidth;
- collective time = the sum over collectives of the bytes one chip sends, for a ring algorithm
  ((n-1)/n of the array for all-gather, reduce-scatter and all-to-all, twice that for all-reduce,
  the array for a permute), over the bandwidth of the links its group spans: on a TPU torus each
  dimension the group varies along contributes two links (both directions), of the chip's
  `ports`; on GPUs NVLink's per-GPU bandwidth. A collective inside a loop counts once per trip
  (XLA's `known_trip_count`, or the count the loop's counter shows: `inferred_trip_count`).

The step time is the largest of the three (compute, memory and collectives perfectly overlapped: a
lower bound), `serial_s` their sum (nothing overlapped: an upper bound); the bound is the largest
term, and the MFU that time implies is the model's FLOPs (models.accounting: 3x the forward, full
score matrices, as PaLM counts them, no recomputation) over step time x peak.
jax.experimental.roofline was considered: it reads a jaxpr, so it sees only the collectives a
program writes (shard_map) and none that GSPMD inserts for fsdp or tensor sharding, which are most
of this project's; the compiled program holds them all.

XLA's cost analysis counts a loop body once; `cost` here is the count with each body times its
runs (training.hlo_cost), so a scanned layer stack counts all its layers.

What it cannot see: a Pallas kernel without a cost estimate counts 0 FLOPs and bytes; a loop whose
trip count the program does not show counts once; latency, launch overheads and the compiler's own
overlap are not modelled.
"""

import math
import re

import numpy as np

# Published figures per chip: peak dense bf16 FLOP/s, HBM bandwidth (bytes/s), bidirectional ICI
# (or NVLink) bandwidth per chip (bytes/s), ICI ports per chip (None: a switch), HBM bytes (the
# GB of the TPU pages read as GiB; libtpu lets a program use 15.75 of v5e's 16 GiB; the H100's
# from its XLA description's device_memory_size).
# Sources: Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p,
# /v6e); v4's ICI from "How to scale your model" (jax-ml.github.io/scaling-book/tpus: 4.5e10 B/s
# one way per link, 6 links), its page giving none; the H100 SXM from NVIDIA's H100 datasheet
# (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 GB/s).
PEAKS = {
    'v4': dict(flops=275e12, hbm_bw=1200e9, ici_bw=540e9, ports=6, hbm=32 * 2 ** 30,
               source='cloud.google.com/tpu/docs/v4; ICI: jax-ml.github.io/scaling-book/tpus'),
    'v5e': dict(flops=197e12, hbm_bw=819e9, ici_bw=400e9, ports=4, hbm=16 * 2 ** 30,
                source='cloud.google.com/tpu/docs/v5e'),
    'v5p': dict(flops=459e12, hbm_bw=2765e9, ici_bw=1200e9, ports=6, hbm=95 * 2 ** 30,
                source='cloud.google.com/tpu/docs/v5p'),
    'v6e': dict(flops=918e12, hbm_bw=1640e9, ici_bw=800e9, ports=4, hbm=32 * 2 ** 30,
                source='cloud.google.com/tpu/docs/v6e'),
    'h100': dict(flops=989e12, hbm_bw=3350e9, ici_bw=900e9, ports=None, hbm=84_978_434_048,
                 source='NVIDIA H100 Tensor Core GPU datasheet (SXM5)'),
}
DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 'f8e4m3fn': 1, 'f8e5m2': 1, 'bf16': 2, 'f16': 2,
               's16': 2, 'u16': 2, 'f32': 4, 's32': 4, 'u32': 4, 'f64': 8, 's64': 8, 'u64': 8}
# Bytes one chip sends per byte of the collective's array, by op, for a group of n.
_SENT = {'all-gather': lambda n: (n - 1) / n, 'reduce-scatter': lambda n: n - 1,
         'all-reduce': lambda n: 2 * (n - 1) / n, 'all-to-all': lambda n: (n - 1) / n,
         'collective-permute': lambda n: 1.0}
_SHAPE = re.compile(r'\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]')
_COLLECTIVE = re.compile(r'^\s*(?:ROOT )?%?\S+ = (.*?) (all-gather|reduce-scatter|all-reduce|'
                         r'all-to-all|collective-permute)(-start)?\((.*)$')
_COMPUTATION = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) (?:\(.*\) -> .*)?\{$')
_CALLEE = re.compile(r'(body|condition|calls|to_apply)=%?([\w.\-]+)|'
                     r'branch_computations=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# One instruction's parts, for the trip count of a loop XLA does not annotate.
_DEF = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = ')
_WHILE = re.compile(r' while\(%?([\w.\-]+)\), condition=%?([\w.\-]+), body=%?([\w.\-]+)')
_COPY = re.compile(r' (?:copy|bitcast|convert)\(%?([\w.\-]+)\)')
_CONSTANT = re.compile(r' constant\((-?\d+)\)')
_GTE = re.compile(r' get-tuple-element\(%?([\w.\-]+)\), index=(\d+)')
_COMPARE = re.compile(r' compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=(\w+)')
_TUPLE = re.compile(r' tuple\((.*?)\)(?:,|$)')
_ADD = re.compile(r' add\(%?([\w.\-]+), %?([\w.\-]+)\)')
# A bracket, or a string (its closing quote in group 1, empty where it runs on to the next line).
_BRACKET_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*("?)|[{}()\[\]]')
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"')


def _array_bytes(text):
  """[bytes of each array shape] in an HLO result type such as '(bf16[8,128]{...}, f32[4])'."""
  out = []
  for dtype, dims in _SHAPE.findall(text):
    if dtype in DTYPE_BYTES:
      out.append(DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d))
  return out


def _still_open(line, depth, in_string):
  """(brackets still open, whether a string is) after `line`, given those before it; brackets in
  strings do not count."""
  pos = 0
  if in_string:
    m = _STRING_REST.match(line)
    if not m:
      return depth, True
    pos = m.end()
  for m in _BRACKET_OR_STRING.finditer(line, pos):
    token = m.group(0)
    if token[0] == '"':
      if not m.group(1):
        return depth, True
    else:
      depth += 1 if token in '{([' else -1
  return depth, False


def _computations(text):
  """{computation name: its instructions, one line each} of an HLO module's text, and the entry's
  name. An instruction XLA prints over several lines (libtpu's splash kernels: a newline inside
  their frontend_attributes, before their backend_config and its cost_estimate) is joined into
  one, the lines after its first read up to where its brackets close."""
  comps, name, entry, depth, in_string = {}, None, None, 0, False
  for line in text.splitlines():
    if name is not None and (depth > 0 or in_string):  # the instruction continues
      comps[name][-1] += ' ' + line
      depth, in_string = _still_open(line, depth, in_string)
      continue
    m = _COMPUTATION.match(line)
    if m:
      name = m.group(1)
      comps[name] = []
      if line.startswith('ENTRY'):
        entry = name
    elif name is not None:
      comps[name].append(line)
      depth, in_string = _still_open(line, 0, False)
  return comps, entry


def _defs(lines):
  """{instruction name: its line} of one computation."""
  return {m.group(1): line for line in lines if (m := _DEF.match(line))}


def _through_copies(defs, name):
  """The instruction `name` is a copy, bitcast or convert of (transitively), or `name`."""
  for _ in range(8):
    m = _COPY.search(defs.get(name, ''))
    if not m:
      break
    name = m.group(1)
  return name


def _int_constant(defs, name):
  m = _CONSTANT.search(defs.get(_through_copies(defs, name), ''))
  return None if m is None else int(m.group(1))


def inferred_trip_count(comps, parent, line):
  """The trip count of the while loop on `line` (in computation `parent`), from the pattern jax's
  scans and fori_loops compile to: the condition's root compares a counter of the loop's tuple
  (element k) with a constant, the counter starts at a constant (the while operand's element k)
  and the body adds a constant to it. None where the program does not show all three (libtpu's
  while loops carry no `known_trip_count`, XLA:GPU's do)."""
  m = _WHILE.search(line)
  if not m:
    return None
  cond, body = comps.get(m.group(2), ()), comps.get(m.group(3), ())
  root = next((x for x in cond if x.lstrip().startswith('ROOT ')), '')
  cmp = _COMPARE.search(root)
  if not cmp:
    return None
  cdefs, bdefs, pdefs = _defs(cond), _defs(body), _defs(comps.get(parent, ()))
  a, b, direction = cmp.groups()
  if _int_constant(cdefs, a) is not None:  # `N > i` is `i < N`
    a, b = b, a
    direction = {'GT': 'LT', 'GE': 'LE', 'LT': 'GT', 'LE': 'GE'}.get(direction, direction)
  gte, limit = _GTE.search(cdefs.get(_through_copies(cdefs, a), '')), _int_constant(cdefs, b)
  if not gte or limit is None or direction not in ('LT', 'LE'):
    return None
  index = int(gte.group(2))
  init_tuple = _TUPLE.search(pdefs.get(_through_copies(pdefs, m.group(1)), ''))
  body_root = _TUPLE.search(next((x for x in body if x.lstrip().startswith('ROOT ')), ''))
  if not init_tuple or not body_root:
    return None
  operands = lambda t: [o.strip().lstrip('%') for o in re.sub(r'/\*.*?\*/', '', t).split(',')]
  init = _int_constant(pdefs, operands(init_tuple.group(1))[index])
  add = _ADD.search(bdefs.get(_through_copies(bdefs, operands(body_root.group(1))[index]), ''))
  if init is None or not add:
    return None
  def is_counter(name):  # the body's own counter, through copies
    gte = _GTE.search(bdefs.get(_through_copies(bdefs, name), ''))
    return gte is not None and int(gte.group(2)) == index
  steps = [_int_constant(bdefs, x) for x in add.groups()]
  step = next((s for s, other in zip(steps, reversed(add.groups()))
               if s is not None and is_counter(other)), None)
  if not step or step <= 0:
    return None
  return max(0, -(-(limit + (direction == 'LE') - init) // step))


def trip_multipliers(text):
  """{computation: how many times it runs per execution of the entry}: a while body its loop's
  trip count (XLA's `known_trip_count`, else `inferred_trip_count`) times its caller's, any other
  callee its caller's (1 where unknown)."""
  comps, entry = _computations(text)
  mult = {entry: 1}
  stack = [entry]
  while stack:
    parent = stack.pop()
    for line in comps.get(parent, ()):
      trip = _TRIP.search(line)
      trip = int(trip.group(1)) if trip else (
          inferred_trip_count(comps, parent, line) if ' while(' in line else None)
      for kind, name, branches in _CALLEE.findall(line):
        for callee in [name] if name else re.split(r'[,\s%]+', branches):
          if callee not in comps:
            continue
          m = mult[parent] * (trip if kind == 'body' and trip is not None else 1)
          if m > mult.get(callee, 0):
            mult[callee] = m
            stack.append(callee)
  return comps, mult


def group_of_first(line, num_partitions):
  """The partition ids of the group that holds partition 0, from a collective's
  `replica_groups` (the explicit `{{0,1},{2,3}}`, iota `[G,S]<=[dims]T(perm)` and Shardy's
  `mesh['a'=2,'b'=4] {'b'}` forms) or `source_target_pairs`; all partitions when absent."""
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    axes = [(a.strip().strip("'"), int(s)) for a, s in
            (p.split('=') for p in m.group(1).split(',') if '=' in p)]
    named = set(re.findall(r"'([^']+)'", m.group(2)))
    ids = [0]
    stride = 1
    for axis, size in reversed(axes):
      if axis in named:
        ids = [i + k * stride for k in range(size) for i in ids]
      stride *= size
    return sorted(ids)
  m = re.search(r'replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', line)
  if m:
    dims = [int(d) for d in m.group(3).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(p) for p in m.group(4).split(',')])
    return sorted(ids.reshape(int(m.group(1)), int(m.group(2)))[0].tolist())
  m = re.search(r'replica_groups=\{\{([\d,]+)\}', line)
  if m:
    return [int(i) for i in m.group(1).split(',')]
  m = re.search(r'source_target_pairs=\{\{(\d+),(\d+)\}', line)
  if m:
    return [int(m.group(1)), int(m.group(2))]
  return list(range(num_partitions))


def collectives(text, num_partitions):
  """[(op, array bytes, group partition ids, times per step)] of every collective in the HLO."""
  comps, mult = trip_multipliers(text)
  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _COLLECTIVE.match(line)
      if not m:
        continue
      sizes = _array_bytes(m.group(1))
      if not sizes:
        continue
      op, started = m.group(2), m.group(3)
      # An async start's result tuple holds the operand beside the result (and, for a permute,
      # two u32 contexts): the largest array is the gathered/permuted one.
      size = max(sizes) if started or op in ('all-gather', 'collective-permute') else sum(sizes)
      out.append((op, size, group_of_first(line, num_partitions), mult.get(name, 1)))
  return out


def dims_spanned(group, devices):
  """How many torus dimensions the devices of `group` (partition ids into `devices`, the program's
  device assignment) vary along; None where the devices have no coordinates (GPUs)."""
  coords = [getattr(devices[i], 'coords', None) for i in group if i < len(devices)]
  if not coords or coords[0] is None:
    return None
  return sum(len({tuple(c)[d] for c in coords}) > 1 for d in range(len(coords[0])))


def collective_seconds(text, devices, chip):
  """(seconds, bytes sent per chip) of all collectives of one step, as the module docstring says."""
  seconds = sent = 0.0
  for op, size, group, times in collectives(text, len(devices)):
    n = len(group)
    if n < 2:
      continue
    nbytes = size * _SENT[op](n) * times
    dims = dims_spanned(group, devices)
    if chip['ports'] is None or dims is None:
      bandwidth = chip['ici_bw'] / 2  # one direction of the GPU's NVLink
    else:
      bandwidth = chip['ici_bw'] * min(2 * max(dims, 1), chip['ports']) / (2 * chip['ports'])
    seconds += nbytes / bandwidth
    sent += nbytes
  return seconds, sent


def estimate(generation, cost, hlo_text, devices, model_flops=None):
  """The roofline estimate of one program on one chip of `generation` (a key of PEAKS), or None
  where the chip's figures or the compiler's cost analysis are missing.

  Args:
    generation: 'v5p', 'h100', ...
    cost: the program's `compiled.cost_analysis()` dict (FLOPs, 'bytes accessed'), its loop
      bodies counted by their trip counts (`hlo_cost.loop_corrected`).
    hlo_text: `compiled.as_text()`.
    devices: the program's devices in mesh order (`mesh.devices.flat`), for the groups' links.
    model_flops: the model's FLOPs per chip of the step (for the MFU), or None.

  Returns:
    {'step_s', 'serial_s', 'bound', 'mfu', 'compute_s', 'memory_s', 'collective_s',
     'collective_bytes', 'compiler_s', 'compiler_unavailable'} (compiler_s: libtpu's own
     `optimal_seconds`, where positive; it counts each loop body once; compiler_unavailable: it
     gave a time <= 0).
  """
  chip = PEAKS.get(generation)
  if chip is None or not cost or 'flops' not in cost:
    return None
  # libtpu's own estimate, where it gives a positive one (it prints negative times for some
  # scanned programs: no estimate).
  compiler = float(cost['optimal_seconds']) if 'optimal_seconds' in cost else None
  terms = {'compute_s': float(cost['flops']) / chip['flops'],
           'memory_s': float(cost.get('bytes accessed', 0.0)) / chip['hbm_bw']}
  terms['collective_s'], sent = collective_seconds(hlo_text, devices, chip)
  step = max(terms.values())
  bound = max(terms, key=terms.get)[:-2]
  mfu = None if not model_flops or step <= 0 else model_flops / (step * chip['flops'])
  return {**terms, 'step_s': step, 'serial_s': sum(terms.values()), 'bound': bound,
          'mfu': mfu, 'collective_bytes': sent,
          'compiler_s': compiler if compiler is not None and compiler > 0 else None,
          'compiler_unavailable': compiler is not None and compiler <= 0}
