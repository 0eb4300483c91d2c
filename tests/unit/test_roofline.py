"""training.roofline: the collectives read from HLO text, the links their groups span, the loop
trip counts, and the estimate's arithmetic against hand-computed values."""
# ruff: noqa: E501  (HLO instructions are one line each, as XLA prints them)

import dataclasses

import pytest

from training import roofline

# A module as XLA prints it: an entry that runs a while loop (known trip count 12) whose body
# all-gathers, and an all-reduce of a tuple in the entry itself.
HLO = """HloModule jit_step, entry_computation_layout={()->f32[]}

%body.1 (p: (s32[], bf16[16,128])) -> (s32[], bf16[16,128]) {
  %p = (s32[], bf16[16,128]{1,0}) parameter(0)
  %all-gather.3 = bf16[16,128]{1,0:T(8,128)(2,1)} all-gather(%x), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
}

%cond.1 (p: (s32[], bf16[16,128])) -> pred[] {
  %p = (s32[], bf16[16,128]{1,0}) parameter(0)
}

ENTRY %main.9 (a: f32[1024]) -> f32[] {
  %while.1 = (s32[], bf16[16,128]{1,0}) while(%t), condition=%cond.1, body=%body.1, backend_config={"known_trip_count":{"n":"12"}}
  %all-reduce.7 = (f32[1024]{0}, f32[256]{0}) all-reduce(%a, %b), channel_id=7, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  ROOT %reduce-scatter.2 = f32[64]{0} reduce-scatter(%c), channel_id=9, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""


@dataclasses.dataclass
class Chip:
  coords: tuple


# Eight chips of a 2x2x2 torus in partition order.
DEVICES = [Chip((i % 2, i // 2 % 2, i // 4)) for i in range(8)]


def test_collectives_sizes_groups_and_trip_counts():
  got = sorted(roofline.collectives(HLO, 8))
  assert got == [
      ('all-gather', 16 * 128 * 2, [0, 1, 2, 3], 12),  # in the loop body: 12 times a step
      ('all-reduce', (1024 + 256) * 4, [0, 4], 1),  # a tuple: both arrays; axis_0 of the mesh
      ('reduce-scatter', 64 * 4, list(range(8)), 1),
  ]


@pytest.mark.parametrize('line,group', [
    ("replica_groups=[2,4]<=[8]", [0, 1, 2, 3]),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", [0, 4]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_1','axis_2'}", [0, 1, 2, 3]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0'}", [0, 4]),
    ("replica_groups={{0,2},{1,3}}", [0, 2]),
    ("source_target_pairs={{0,1},{1,0}}", [0, 1]),
    ("channel_id=1", list(range(8))),  # no groups: every partition
])
def test_group_of_first_reads_every_form(line, group):
  assert roofline.group_of_first(line, 8) == group


def test_dims_spanned_counts_torus_dimensions():
  assert roofline.dims_spanned([0, 1], DEVICES) == 1
  assert roofline.dims_spanned([0, 1, 2, 3], DEVICES) == 2
  assert roofline.dims_spanned(list(range(8)), DEVICES) == 3
  assert roofline.dims_spanned([0, 1], [object(), object()]) is None  # GPUs: no coordinates


def test_estimate_by_hand_on_v5p():
  chip = roofline.PEAKS['v5p']
  cost = {'flops': 4.59e12, 'bytes accessed': 2.765e9, 'optimal_seconds': 0.5}
  e = roofline.estimate('v5p', cost, HLO, DEVICES, model_flops=2.295e12)
  link = chip['ici_bw'] / chip['ports']  # both directions of one link
  # all-gather: 12 x 4096 B x 3/4 over the two dims of {0..3} (4 links of 6);
  # all-reduce: 2 x 5120 B x 1/2 over one dim; reduce-scatter: 256 B x 7 over three dims.
  want = (12 * 4096 * 0.75 / (2 * link) + 2 * 5120 * 0.5 / link + 256 * 7 / (3 * link))
  assert e['compute_s'] == pytest.approx(0.01)
  assert e['memory_s'] == pytest.approx(1e-3)
  assert e['collective_s'] == pytest.approx(want)
  assert e['collective_bytes'] == pytest.approx(12 * 4096 * 0.75 + 5120 + 256 * 7)
  assert e['bound'] == 'compute' and e['step_s'] == pytest.approx(0.01)
  assert e['serial_s'] == pytest.approx(0.01 + 1e-3 + want)
  assert e['mfu'] == pytest.approx(0.5)
  assert e['compiler_s'] == 0.5


def test_estimate_is_none_without_figures_or_cost():
  assert roofline.estimate('v9z', {'flops': 1.0}, HLO, DEVICES) is None
  assert roofline.estimate('v5p', None, HLO, DEVICES) is None


def test_every_chip_has_its_figures_and_a_source():
  for gen, chip in roofline.PEAKS.items():
    assert chip['flops'] > 1e14 and chip['hbm_bw'] > 1e11 and chip['ici_bw'] > 1e10, gen
    assert chip['source'], gen
