"""training.hlo_cost and the loops of training.roofline: a loop body counted as many times as it
runs, the trip count read from a loop XLA does not annotate (libtpu's), and libtpu's negative
estimate reported as none."""
# ruff: noqa: E501  (HLO instructions are one line each, as XLA prints most of them)

import jax
import jax.numpy as jnp
import pytest

from training import hlo_cost
from training import roofline

# libtpu's form of a scan of 5 layers: no known_trip_count; the counter (element 0) starts at a
# copy of the constant 0, the condition compares it with 5, the body adds 1 to a copy of it (as
# under model.remat).
HLO = """HloModule jit_step, num_partitions=8

%cond.1 (p: (s32[], f32[8])) -> pred[] {
  %c5 = s32[]{:T(128)} constant(5)
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt.1 = pred[]{:T(512)} compare(%i, %c5), direction=LT, metadata={op_name="while/cond/lt"}
}

%body.1 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %one = s32[]{:T(128)} constant(1)
  %i.copy = s32[]{:T(128)} copy(%i)
  %next = s32[]{:T(128)} add(%i.copy, %one)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %y = f32[8]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  ROOT %t = (s32[]{:T(128)}, f32[8]{0}) tuple(%next, /*index=1*/%y)
}

ENTRY %main.2 (a: f32[8]) -> f32[8] {
  %zero = s32[]{:T(128)} constant(0)
  %copy.1 = s32[]{:T(128)} copy(%zero)
  %a = f32[8]{0} parameter(0)
  %tuple.1 = (s32[]{:T(128)}, f32[8]{0}) tuple(%copy.1, %a)
  %while.1 = (s32[]{:T(128)}, f32[8]{0}) while(%tuple.1), condition=%cond.1, body=%body.1
  ROOT %r = f32[8]{0} get-tuple-element(%while.1), index=1
}
"""


def test_trip_count_inferred_from_the_loop_counter():
  comps, mult = roofline.trip_multipliers(HLO)
  assert mult['body.1'] == 5
  assert [c[3] for c in roofline.collectives(HLO, 8)] == [5]  # the body's all-reduce, 5 times
  # Starting at 2 instead: 3 trips; a limit that is not a constant: unknown.
  assert roofline.trip_multipliers(HLO.replace('constant(0)', 'constant(2)'))[1]['body.1'] == 3
  unknown = HLO.replace('compare(%i, %c5)', 'compare(%i, %x)')
  assert roofline.trip_multipliers(unknown)[1]['body.1'] == 1


def _scan(w, x):
  return jax.lax.scan(lambda x, wi: (jnp.tanh(x @ wi), None), x, w)[0].sum()


def _unrolled(w, x):
  for i in range(w.shape[0]):
    x = jnp.tanh(x @ w[i])
  return x.sum()


def test_scanned_flops_count_every_layer():
  """A scanned stack's gradient, compiled for this CPU: XLA counts its two loops' bodies (forward,
  backward) once; corrected, the FLOPs are within 5% of the unrolled program's (the scan adds its
  slicing and stacking)."""
  w = jax.ShapeDtypeStruct((6, 64, 64), jnp.float32)
  x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
  scanned, unrolled = (jax.jit(jax.grad(f)).lower(w, x).compile() for f in (_scan, _unrolled))
  cost, loops, counted = hlo_cost.loop_corrected(scanned.cost_analysis(), scanned.as_text())
  assert counted and sorted(loops.values()) == [6, 6]
  want = unrolled.cost_analysis()['flops']
  assert cost['flops_counted_once'] < 0.3 * want  # one layer of six, and the rest
  assert cost['flops'] == pytest.approx(want, rel=0.05)
  assert cost['bytes accessed'] > cost['bytes accessed counted once']
  # No loop: XLA's count as it is.
  plain = unrolled.cost_analysis()
  assert hlo_cost.loop_corrected(plain, unrolled.as_text()) == (plain, {}, True)


def test_kernel_cost_estimates_in_a_body_count_per_run():
  call = ('  %k = f32[8]{0} custom-call(%x), custom_call_target="tpu_custom_call", backend_config='
          '{"custom_call_config":{"cost_estimate":{"flops":"1000","transcendentals":"0",'
          '"bytes_accessed":"64"}}}\n')
  assert hlo_cost._custom_call_costs(call.splitlines()) == (1000.0, 64.0)


def test_negative_libtpu_estimate_is_unavailable():
  e = roofline.estimate('v5p', {'flops': 1e12, 'bytes accessed': 1e9,
                                'optimal_seconds': -12.9}, HLO, [None] * 8)
  assert e['compiler_s'] is None and e['compiler_unavailable']


# The body of HLO's loop with a kernel as libtpu prints splash attention's: a newline inside its
# frontend_attributes, so its backend_config (the cost_estimate) is on the instruction's third line.
KERNEL = ('  %k = f32[8]{0} custom-call(%y), custom_call_target="tpu_custom_call", '
          'frontend_attributes={kernel_metadata={\n'
          '"xprof_metadata":"{\\"block_q\\": 128, \\"q_layout\\": 1}"\n'
          '}}, metadata={op_name="splash_mha_fwd/pallas_call"}, backend_config={"custom_call_config":'
          '{"body":"TUzvUg","cost_estimate":{"flops":"1000","transcendentals":"0",'
          '"bytes_accessed":"64"}}}\n')
ADD = '''%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

'''
HLO_KERNEL = HLO.replace(
    '  ROOT %t = (s32[]{:T(128)}, f32[8]{0}) tuple(%next, /*index=1*/%y)',
    KERNEL + '  ROOT %t = (s32[]{:T(128)}, f32[8]{0}) tuple(%next, /*index=1*/%k)').replace(
        '%cond.1 ', ADD + '%cond.1 ')  # the all-reduce's reduction, for XLA's parser


def test_kernel_printed_over_several_lines_counts_per_run():
  """Its three lines read as one instruction: the kernel's 1000 FLOPs count in each of the 5 runs
  (read line by line, its cost_estimate was not on the custom-call's line and counted 0)."""
  comps, _ = roofline._computations(HLO_KERNEL)
  call = [x for x in comps['body.1'] if ' custom-call(' in x]
  assert len(call) == 1 and hlo_cost._custom_call_costs(call) == (1000.0, 64.0)
  assert 'ROOT' not in call[0] and call[0].endswith('"64"}}}')  # its lines, and no more
  cost, loops, counted = hlo_cost.loop_corrected({'flops': 1e6, 'bytes accessed': 1e3},
                                                 HLO_KERNEL)
  body = hlo_cost._generic_cost(HLO_KERNEL, 'body.1')['flops']
  assert counted and loops == {'body.1': 5}
  assert cost['flops'] == pytest.approx(1e6 + 4 * (body + 1000))
