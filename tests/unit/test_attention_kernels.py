"""The blockwise and Pallas flash kernels against the dense `xla` reference: forward and
gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from layers import attention
from layers import attention_blockwise
from layers import attention_xla
from layers import flash_core
from layers import masks
from tests.helpers import quick_jit

B, N, H = 2, 4, 8
# Tiles smaller than the lengths (37 is a multiple of neither), so every test crosses tile edges,
# skips tiles and pads the last one.
BLOCK_Q, BLOCK_K = 16, 8


CASES = {
    'mha': dict(),
    'divisible_T32': dict(t=32, s=32),
    'causal': dict(is_causal=True),
    'window_int_mqa': dict(local_window_size=5, kv_heads=1),
    'window_asym': dict(local_window_size=(9, 2)),
    'causal_window_gqa': dict(is_causal=True, local_window_size=(6, 0), kv_heads=2),
    'alibi_causal_gqa': dict(is_causal=True, alibi=True, kv_heads=2),
    'alibi_bidirectional_mqa': dict(alibi=True, kv_heads=1),
    'segments_mqa': dict(segments=True, kv_heads=1),
    'segments_causal_alibi_gqa': dict(segments=True, is_causal=True, alibi=True, kv_heads=2),
    'cross_T37_S21_causal_segments': dict(t=37, s=21, is_causal=True, segments=True, kv_heads=2),
    'cross_T16_S37_window_alibi': dict(t=16, s=37, local_window_size=(3, 11), alibi=True),
    'bias_mask_causal_gqa': dict(bias=True, mask=True, is_causal=True, kv_heads=2),
    'bias_per_head_broadcast_q': dict(bias='row', kv_heads=2),
    'bf16_causal_gqa': dict(dtype=jnp.bfloat16, is_causal=True, kv_heads=2),
    'bf16_window_alibi_segments': dict(dtype=jnp.bfloat16, local_window_size=(7, 3), alibi=True,
                                       segments=True),
}

PALLAS_CASES = ['mha', 'window_int_mqa', 'segments_causal_alibi_gqa',
                'cross_T37_S21_causal_segments', 'bias_mask_causal_gqa', 'bf16_causal_gqa']


def _segments(length, every, offset):
  """Packed rows: segment ids that change every `every` tokens, shifted per batch row."""
  return (np.arange(length)[None] // every + np.array([[0], [offset]])).astype(np.int32)  # [B, L]


def _inputs(t, s, kv_heads, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, t, N, H), np.float32)
  k = rng.standard_normal((B, s, kv_heads, H), np.float32)
  v = rng.standard_normal((B, s, kv_heads, H), np.float32)
  ct = rng.standard_normal((B, t, N, H), np.float32)
  return [jnp.asarray(x, dtype) for x in (q, k, v)], jnp.asarray(ct)


def _value_and_grads(impl, q, k, v, ct, bias=None, **kwargs):
  """Output and the vjp of `ct` w.r.t. q, k, v (and bias), in one jit."""

  @quick_jit
  def run(q, k, v, bias, ct):
    def f(q, k, v, bias):
      return attention.dot_product_attention(q, k, v, bias, implementation=impl, **kwargs)
    out, vjp = jax.vjp(f, q, k, v, bias)
    return out, vjp(ct.astype(out.dtype))

  return run(q, k, v, bias, ct)


def _compare(impl, case):
  c = dict(CASES[case])
  t, s = c.pop('t', 37), c.pop('s', 37)
  kv_heads, dtype = c.pop('kv_heads', N), c.pop('dtype', jnp.float32)
  rng = np.random.default_rng(1)
  bias = None
  if c.pop('bias', False) == 'row':
    bias = jnp.asarray(rng.standard_normal((1, N, 1, s)), jnp.float32)  # broadcast over B and T
  elif case.startswith('bias'):
    bias = jnp.asarray(rng.standard_normal((B, N, t, s)), jnp.float32)
  if c.pop('mask', False):
    c['mask'] = jnp.asarray(rng.random((B, 1, t, s)) < 0.7)
  if c.pop('alibi', False):
    c['alibi_slopes'] = jnp.asarray(2.0 ** (-8.0 * np.arange(1, N + 1) / N), jnp.float32)
  if c.pop('segments', False):
    c['segment_ids'] = (jnp.asarray(_segments(t, 7, 1)), jnp.asarray(_segments(s, 5, 2)))
  (q, k, v), ct = _inputs(t, s, kv_heads, dtype)
  f32 = lambda x: x.astype(jnp.float32)
  want_out, want_grads = _value_and_grads('xla', f32(q), f32(k), f32(v), ct, bias, **c)
  got_out, got_grads = _value_and_grads(impl, q, k, v, ct, bias, **c)
  assert got_out.dtype == dtype
  tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=6e-2, rtol=6e-2)
  np.testing.assert_allclose(f32(got_out), want_out, **tol)
  names = ('dq', 'dk', 'dv', 'dbias')
  for name, got, want in zip(names, got_grads, want_grads):
    if want is None:
      continue
    np.testing.assert_allclose(f32(got), want, err_msg=name, **tol)


@pytest.mark.parametrize('case', list(CASES))
def test_blockwise_matches_xla(case):
  _compare('blockwise', case)


@pytest.mark.parametrize('case', PALLAS_CASES)
def test_pallas_matches_xla(case):
  _compare('pallas', case)


@pytest.mark.parametrize('impl', ['blockwise', 'pallas'])
def test_rows_without_visible_keys_are_zero_with_finite_gradients(impl):
  t = s = 37
  (q, k, v), ct = _inputs(t, s, 2, jnp.float32)
  q_seg = _segments(t, 7, 0)
  q_seg[:, 30:] = 99  # a segment that no key belongs to
  kv_seg = _segments(s, 7, 0)
  kwargs = dict(segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)), is_causal=True)
  out, grads = _value_and_grads(impl, q, k, v, ct, **kwargs)
  want_out, want_grads = _value_and_grads('xla', q, k, v, ct, **kwargs)
  np.testing.assert_array_equal(out[:, 30:], 0.0)
  assert np.abs(np.asarray(out[:, :30])).sum() > 0  # the other rows are not zeroed too
  np.testing.assert_array_equal(grads[0][:, 30:], 0.0)
  for got, want in zip(grads[:3], want_grads[:3]):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_blockwise_residuals_are_linear_in_length():
  """The custom VJP saves O(T) arrays only; autodiff through the scan would save [.., T, S]
  blocks."""
  t = s = 256
  (q, k, v), _ = _inputs(t, s, 2, jnp.float32)
  kwargs = dict(scale=0.3, is_causal=True, alibi_slopes=jnp.ones(N),
                q_segment_ids=jnp.zeros((B, t), jnp.int32),
                kv_segment_ids=jnp.zeros((B, s), jnp.int32))

  def largest_residual(f):
    _, vjp = jax.vjp(lambda q, k, v: f(q, k, v, **kwargs), q, k, v)
    return max(leaf.size for leaf in jax.tree_util.tree_leaves(vjp))

  quadratic = B * N * t * s  # one score matrix: 524,288 elements
  assert largest_residual(attention_xla.attention) >= quadratic  # the check can see quadratic ones
  blockwise = functools.partial(attention_blockwise.attention, block_q=32, block_k=32)
  assert largest_residual(blockwise) <= q.size  # 16,384: [B, T, N, H]


@pytest.mark.parametrize('is_causal,window', [(True, None), (False, (5, 0)), (False, (0, 17)),
                                               (True, (40, 3)), (False, (-3, 9))],
                         ids=['causal', 'window_left', 'window_right', 'causal_window',
                              'window_negative_left'])
def test_bands_are_exactly_the_tiles_with_visible_keys(is_causal, window):
  """Tiles outside the band are skipped; the band must hold every visible tile, and no other."""
  t, s, bq, bk = 70, 53, 16, 8
  nq, nk = -(-t // bq), -(-s // bk)
  cfg = flash_core.TileConfig(1.0, is_causal, window, t, s, bq, bk)
  vis = masks.visible(np.arange(nq * bq)[:, None], np.arange(nk * bk)[None, :],
                      is_causal=is_causal, window=window)  # [Tp, Sp]
  tiles = vis.reshape(nq, bq, nk, bk).any(axis=(1, 3))  # [nq, nk]
  for i in range(nq):
    lo, hi = flash_core.key_block_band(i, cfg, nk)
    np.testing.assert_array_equal(np.arange(nk)[(np.arange(nk) >= lo) & (np.arange(nk) < hi)],
                                  np.flatnonzero(tiles[i]), err_msg=f'query tile {i}')
  for j in range(nk):
    lo, hi = flash_core.query_block_band(j, cfg, nq)
    np.testing.assert_array_equal(np.arange(nq)[(np.arange(nq) >= lo) & (np.arange(nq) < hi)],
                                  np.flatnonzero(tiles[:, j]), err_msg=f'key tile {j}')
