"""A compiled program's FLOPs and bytes accessed with each loop body counted its trip count times.

XLA's `compiled.cost_analysis()` (libtpu's on TPU) walks a while loop's body once, whatever its
trip count: a scanned layer stack (`model.scan_layers`) of L layers reads as one layer. This module
reads the compiled program instead: for every while body whose trip count the program shows
(`roofline.trip_multipliers`), it adds the body's own cost times the runs XLA left out:

    corrected = XLA's total + sum over loop bodies b of (runs of b per step - 1) x own(b)

where own(b) is the body's cost without the loops nested in it (they are counted for themselves).
A body's cost is XLA's own HloCostAnalysis of that body (jaxlib's `hlo_module_cost_analysis`, run
on this host's CPU client over the compiled HLO text with the body as the entry) plus the cost
estimates the Mosaic kernels in it carry (`cost_estimate` in their backend_config), which the
generic analysis does not read. libtpu's FLOPs are exactly those two together (measured on the
decoder-only train step, scanned and unrolled: equal to 1e-6), so a scanned step's corrected FLOPs
are what libtpu would count for the program unrolled. Its bytes accessed are not: libtpu counts
more bytes than the generic analysis for the same program (about 3x at the quick config's sizes,
its own memory-space and tiling model), so the bytes the bodies add are the generic analysis's, a
lower bound of libtpu's way of counting them.
"""

import itertools
import json
import re

from training import roofline

_CUSTOM_COST = re.compile(r'"cost_estimate":(\{[^}]*\})')
_HEADER_KEEP = re.compile(r'\b(?:num_partitions|replica_count)=\d+')


def _custom_call_costs(lines):
  """(FLOPs, bytes) the kernels on `lines` declare in their backend_config's cost_estimate."""
  flops = nbytes = 0.0
  for line in lines:
    m = _CUSTOM_COST.search(line) if ' custom-call(' in line else None
    if m:
      estimate = json.loads(m.group(1))
      flops += float(estimate.get('flops', 0))
      nbytes += float(estimate.get('bytes_accessed', 0))
  return flops, nbytes


def _generic_cost(text, entry):
  """XLA's generic HloCostAnalysis ({'flops', 'bytes accessed', ...}) of computation `entry` of
  the module `text`, run as the entry of a module of its own; None where jaxlib cannot (no CPU
  client, or a text its parser refuses)."""
  import jax
  from jaxlib import _hlo
  from jaxlib import _jax
  lines = text.splitlines()
  header = ', '.join(['HloModule cost_of_loop_body'] + _HEADER_KEEP.findall(lines[0]))
  out = [header]
  for line in lines[1:]:
    m = roofline._COMPUTATION.match(line)
    if m:
      line = line.removeprefix('ENTRY ')
      line = 'ENTRY ' + line if m.group(1) == entry else line
    out.append(line)
  try:
    module = _hlo.hlo_module_from_text('\n'.join(out))
    return _jax.hlo_module_cost_analysis(jax.devices('cpu')[0].client, module)
  except Exception:  # noqa: BLE001  (any parser or backend refusal: the loop stays uncorrected)
    return None


def _callees(line, comps):
  for _, name, branches in roofline._CALLEE.findall(line):
    for callee in [name] if name else re.split(r'[,\s%]+', branches):
      if callee in comps:
        yield callee


def _loop_bodies(comps, start):
  """(the while bodies reached from `start` through calls, fusions and branches but no other
  loop, every computation so reached)."""
  bodies, seen, stack = [], {start}, [start]
  while stack:
    for line in comps[stack.pop()]:
      body = roofline._WHILE.search(line)
      for callee in _callees(line, comps):
        if body and callee == body.group(3):
          bodies.append(callee)
        elif callee not in seen and not (body and callee == body.group(2)):
          seen.add(callee)
          stack.append(callee)
  return bodies, seen


def loop_corrected(cost, text):
  """`cost` (a `compiled.cost_analysis()` dict) with 'flops' and 'bytes accessed' counting each
  while body as many times as it runs per step, as the module docstring says.

  Returns:
    (the corrected dict, with XLA's own totals kept as 'flops_counted_once' and 'bytes accessed
    counted once'; {body: runs per step} of the loops, those of unknown trip count at 1;
    False where a body's cost could not be read and the totals are XLA's alone).
  """
  comps, mult = roofline.trip_multipliers(text)
  bodies = sorted({w.group(3) for line in itertools.chain(*comps.values())
                   if (w := roofline._WHILE.search(line)) and w.group(3) in comps})
  loops = {b: mult.get(b, 1) for b in bodies}
  if not cost or 'flops' not in cost or not any(m > 1 for m in loops.values()):
    return cost, loops, True
  generic = {b: _generic_cost(text, b) for b in loops}
  if any(g is None for g in generic.values()):
    return cost, loops, False
  add_flops = add_bytes = 0.0
  for body, runs in loops.items():
    nested, reached = _loop_bodies(comps, body)
    own_flops = generic[body]['flops'] - sum(generic[c]['flops'] for c in nested)
    own_bytes = (generic[body]['bytes accessed'] -
                 sum(generic[c]['bytes accessed'] for c in nested))
    own_flops += _custom_call_costs(line for c in reached for line in comps[c])[0]
    add_flops += (runs - 1) * own_flops
    add_bytes += (runs - 1) * own_bytes
  out = dict(cost)
  out['flops_counted_once'] = float(cost['flops'])
  out['bytes accessed counted once'] = float(cost.get('bytes accessed', 0.0))
  out['flops'] = float(cost['flops']) + add_flops
  out['bytes accessed'] = float(cost.get('bytes accessed', 0.0)) + add_bytes
  return out, loops, True
