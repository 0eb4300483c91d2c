"""The Mosaic TPU flash kernels, run in Pallas's TPU interpret mode, against the dense
`xla` reference.

The interpreter runs the kernel as written for the chip (VMEM/SMEM scratch carried along the grid's
"arbitrary" axis, the band's skipped steps, the clamped index maps), so these numbers are the
kernel's numbers; it is slow, hence one batch row, few heads and lengths of one to three 128-tiles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import attention_pallas_tpu
from layers import attention_xla
from tests.helpers import quick_jit

B, H = 1, 32
FWD_TOL, GRAD_TOL = 2e-5, 1e-4  # float32, absolute (the bar)
BF16_TOL = 6e-2  # as the other kernels' bfloat16 tests: bfloat16 has 8 bits of mantissa

# Lengths that are not multiples of the 128 tile (200, 130, 300) pad and mask the last tile.
CASES = {
    'mha_T200': dict(n=2, kv=2),
    'window_mqa_T300': dict(n=2, kv=1, t=300, s=300, window=(40, 10)),
    'causal_window_alibi_T300': dict(n=2, kv=2, t=300, s=300, is_causal=True, window=(100, 0),
                                     alibi=True),
    'segments_causal_alibi_gqa': dict(n=4, kv=2, is_causal=True, alibi=True, segments=True),
    'cross_T200_S130_causal_segments': dict(n=2, kv=1, s=130, is_causal=True, segments=True),
    'cross_T100_S300_window_alibi': dict(n=2, kv=2, t=100, s=300, window=(3, 150), alibi=True),
    'bf16_causal_gqa': dict(n=4, kv=2, is_causal=True, dtype=jnp.bfloat16),
    'bf16_window_alibi_segments_mqa': dict(n=2, kv=1, window=(70, 20), alibi=True, segments=True,
                                           dtype=jnp.bfloat16),
}


def _segments(length, every, offset):
  return jnp.asarray((np.arange(length)[None] // every + offset).astype(np.int32))  # [B, L]


def _run(impl, q, k, v, ct, **kwargs):
  """Output and the vjp of `ct` w.r.t. q, k, v, in one jit."""

  @quick_jit
  def run(q, k, v, ct):
    out, vjp = jax.vjp(lambda q, k, v: impl(q, k, v, **kwargs), q, k, v)
    return out, vjp(ct.astype(out.dtype))

  return run(q, k, v, ct)


def _tpu(q, k, v, **kwargs):
  return attention_pallas_tpu.attention(q, k, v, interpret=True, **kwargs)


def _inputs(t, s, n, kv, dtype, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(B, t, n, H), (B, s, kv, H), (B, s, kv, H), (B, t, n, H)]
  q, k, v, ct = (rng.standard_normal(shape, np.float32) for shape in shapes)
  return [jnp.asarray(x, dtype) for x in (q, k, v)], jnp.asarray(ct)


def _errors(case):
  """Max |tpu - xla| of out, dq, dk, dv (reference in float32) and the dtype the kernel returned."""
  c = dict(CASES[case])
  t, s = c.pop('t', 200), c.pop('s', 200)
  n, kv, dtype = c.pop('n'), c.pop('kv'), c.pop('dtype', jnp.float32)
  kwargs = dict(scale=0.3, is_causal=c.pop('is_causal', False), window=c.pop('window', None))
  if c.pop('alibi', False):
    kwargs['alibi_slopes'] = jnp.asarray(2.0 ** (-8.0 * np.arange(1, n + 1) / n), jnp.float32)
  if c.pop('segments', False):
    kwargs['q_segment_ids'], kwargs['kv_segment_ids'] = _segments(t, 70, 1), _segments(s, 50, 1)
  assert not c, c
  (q, k, v), ct = _inputs(t, s, n, kv, dtype)
  f32 = lambda x: np.asarray(x, np.float32)
  want = _run(attention_xla.attention, *(x.astype(jnp.float32) for x in (q, k, v)), ct, **kwargs)
  got = _run(_tpu, q, k, v, ct, **kwargs)
  errors = {'out': np.abs(f32(got[0]) - f32(want[0])).max()}
  for name, a, b in zip(('dq', 'dk', 'dv'), got[1], want[1]):
    errors[name] = np.abs(f32(a) - f32(b)).max()
  return errors, got[0].dtype


@pytest.mark.parametrize('case', list(CASES))
def test_tpu_kernel_matches_xla_in_interpret_mode(case):
  errors, dtype = _errors(case)
  want_dtype = CASES[case].get('dtype', jnp.float32)
  assert dtype == want_dtype
  if want_dtype == jnp.float32:
    limits = {'out': FWD_TOL, 'dq': GRAD_TOL, 'dk': GRAD_TOL, 'dv': GRAD_TOL}
  else:
    limits = dict.fromkeys(errors, BF16_TOL)
  assert all(errors[name] <= limits[name] for name in errors), errors


def test_tiles_outside_the_band_are_skipped_not_masked():
  """Keys of the last tile are out of every query's window and hold NaN: a masked tile would still
  multiply its zero probabilities by them (0 * NaN = NaN); a skipped one is never read."""
  t, s, window = 128, 384, (0, 10)  # queries 0..127 reach keys <= 137: key tile 2 is out of reach
  (q, k, v), ct = _inputs(t, s, 2, 2, jnp.float32)
  k, v = k.at[:, 256:].set(jnp.nan), v.at[:, 256:].set(jnp.nan)
  kwargs = dict(scale=0.3, window=window)
  out, (dq, dk, dv) = _run(_tpu, q, k, v, ct, **kwargs)
  want_out, (want_dq, want_dk, want_dv) = _run(attention_xla.attention, q, k[:, :256], v[:, :256],
                                               ct, **kwargs)
  np.testing.assert_allclose(out, want_out, atol=FWD_TOL, rtol=0)
  np.testing.assert_allclose(dq, want_dq, atol=GRAD_TOL, rtol=0)
  np.testing.assert_allclose(dk[:, :256], want_dk, atol=GRAD_TOL, rtol=0)
  np.testing.assert_allclose(dv[:, :256], want_dv, atol=GRAD_TOL, rtol=0)
  np.testing.assert_array_equal(dk[:, 256:], 0.0)  # no query tile visited the skipped key tile
  np.testing.assert_array_equal(dv[:, 256:], 0.0)


def test_rows_without_visible_keys_are_zero_with_finite_gradients():
  t = s = 200
  (q, k, v), ct = _inputs(t, s, 2, 1, jnp.float32)
  q_seg = np.asarray(_segments(t, 70, 0)).copy()
  q_seg[:, 150:] = 99  # a segment no key belongs to
  kwargs = dict(scale=0.3, is_causal=True, q_segment_ids=jnp.asarray(q_seg),
                kv_segment_ids=_segments(s, 70, 0))
  out, grads = _run(_tpu, q, k, v, ct, **kwargs)
  want_out, want_grads = _run(attention_xla.attention, q, k, v, ct, **kwargs)
  np.testing.assert_array_equal(out[:, 150:], 0.0)
  np.testing.assert_allclose(out, want_out, atol=FWD_TOL, rtol=0)
  np.testing.assert_array_equal(grads[0][:, 150:], 0.0)
  for got, want in zip(grads, want_grads):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=0)


def test_head_dim_above_128_is_padded_to_whole_lanes_exactly():
  """H=192 is not a lane multiple: the kernel runs at 256 and drops the padding's columns."""
  rng = np.random.default_rng(3)
  q, k, v, ct = (jnp.asarray(rng.standard_normal((B, 130, 1, 192)), jnp.float32) for _ in range(4))
  kwargs = dict(scale=0.1, is_causal=True)
  out, grads = _run(_tpu, q, k, v, ct, **kwargs)
  want_out, want_grads = _run(attention_xla.attention, q, k, v, ct, **kwargs)
  assert out.shape == q.shape and all(g.shape == q.shape for g in grads)
  np.testing.assert_allclose(out, want_out, atol=FWD_TOL, rtol=0)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, atol=GRAD_TOL, rtol=0)


def test_tiles_must_be_lane_multiples():
  (q, k, v), _ = _inputs(128, 128, 1, 1, jnp.float32)
  with pytest.raises(ValueError, match='multiples of 128'):
    attention_pallas_tpu.attention(q, k, v, scale=1.0, block_q=64, interpret=True)
