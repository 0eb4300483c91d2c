"""The dense reference `dot_product_attention` against a naive einsum-softmax, forward and
gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers import attention

jax.config.update('jax_default_matmul_precision', 'highest')


CASES = {
    'mha': dict(n=4, k=4, causal=False, window=None, pad=False),
    'gqa_causal': dict(n=4, k=2, causal=True, window=None, pad=False),
    'mqa_window': dict(n=4, k=1, causal=False, window=2, pad=False),
    'causal_window_padding': dict(n=4, k=2, causal=True, window=3, pad=True),
    'mha_padding': dict(n=2, k=2, causal=False, window=None, pad=True),
}


def naive(q, k, v, mask):
  """Repeat K/V heads, softmax over an explicit `[B, N, T, S]` mask; hidden rows give zeros."""
  g = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, g, axis=2)
  v = jnp.repeat(v, g, axis=2)
  s = jnp.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(mask, s, -1e30)
  p = jax.nn.softmax(s, axis=-1) * jnp.any(mask, -1, keepdims=True)
  return jnp.einsum('BNTS,BSNH->BTNH', p, v)


def explicit_mask(b, n, t, s, causal, window, seg_q, seg_k):
  """Visibility built with Python loops, independent of layers.masks."""
  m = np.ones((b, n, t, s), bool)
  for i in range(t):
    for j in range(s):
      ok = True
      if causal:
        ok &= j <= i
      if window is not None:
        ok &= i - window <= j <= i + window
      m[:, :, i, j] &= ok
  if seg_q is not None:
    m &= (np.asarray(seg_q)[:, None, :, None] == np.asarray(seg_k)[:, None, None, :])
  return jnp.asarray(m)


@pytest.mark.parametrize('name', list(CASES))
def test_reference_matches_naive_forward_and_gradient(name):
  c = CASES[name]
  b, t, h = 2, 11, 8
  kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (b, t, c['n'], h))
  k = jax.random.normal(kk, (b, t, c['k'], h))
  v = jax.random.normal(kv, (b, t, c['k'], h))
  seg = None
  if c['pad']:
    # Row 0: 8 real tokens then padding (id 0); row 1: two packed segments.
    seg = jnp.array([[1] * 8 + [0] * 3, [1] * 5 + [2] * 6])
  mask = explicit_mask(b, c['n'], t, t, c['causal'], c['window'], seg, seg)
  fn = lambda q, k, v: attention.dot_product_attention(
      q, k, v, is_causal=c['causal'], local_window_size=c['window'], segment_ids=seg)
  ref = lambda q, k, v: naive(q, k, v, mask)
  np.testing.assert_allclose(fn(q, k, v), ref(q, k, v), atol=1e-6, rtol=1e-6)
  w = jax.random.normal(kg, (b, t, c['n'], h))
  g = jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2))(q, k, v)
  for a, r in zip(g, g_ref):
    np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)


def test_mask_bias_alibi_and_cross_lengths():
  b, t, s, n, h = 2, 5, 7, 4, 8
  kq, kk, kv, kb = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(kq, (b, t, n, h))
  k = jax.random.normal(kk, (b, s, 2, h))
  v = jax.random.normal(kv, (b, s, 2, h))
  bias = jax.random.normal(kb, (1, n, t, s))
  mask = jnp.asarray(np.random.default_rng(0).random((b, 1, t, s)) > 0.3)
  slopes = jnp.array([0.5, 0.25, 0.125, 0.0625])
  out = attention.dot_product_attention(q, k, v, bias=bias, mask=mask, alibi_slopes=slopes)
  dist = np.abs(np.arange(t)[:, None] - np.arange(s)[None])
  alibi = -np.asarray(slopes)[:, None, None] * dist
  g = n // 2
  kr, vr = jnp.repeat(k, g, 2), jnp.repeat(v, g, 2)
  scores = jnp.einsum('BTNH,BSNH->BNTS', q, kr) / np.sqrt(h) + bias + alibi
  scores = jnp.where(mask, scores, -1e30)
  p = jax.nn.softmax(scores, -1) * jnp.any(mask, -1, keepdims=True)
  np.testing.assert_allclose(out, jnp.einsum('BNTS,BSNH->BTNH', p, vr), atol=1e-6)


def test_fully_masked_row_is_zero_and_gradient_finite():
  q = jax.random.normal(jax.random.key(2), (1, 4, 2, 8))
  k = jax.random.normal(jax.random.key(3), (1, 4, 2, 8))
  seg_q = jnp.array([[1, 1, 3, 3]])
  seg_k = jnp.array([[1, 1, 2, 2]])  # segment 3 has no keys
  f = lambda q, k: attention.dot_product_attention(q, k, k, segment_ids=(seg_q, seg_k))
  out = f(q, k)
  np.testing.assert_array_equal(out[:, 2:], 0.0)
  assert np.all(np.abs(out[:, :2]) > 0)
  grads = jax.grad(lambda q, k: jnp.sum(f(q, k)), argnums=(0, 1))(q, k)
  assert all(np.all(np.isfinite(g_)) for g_ in grads)


def test_scaling_brings_score_variance_to_one():
  # Var(q·k) = d_k for independent unit-variance components (a sum of d_k products of variance 1);
  # 1/sqrt(d_k) brings it to 1 (ARCHITECTURE.md, "Facts the tests check").
  d = 64
  q = jax.random.normal(jax.random.key(4), (200000, d))
  k = jax.random.normal(jax.random.key(5), (200000, d))
  dots = jnp.sum(q * k, -1)
  assert abs(float(jnp.var(dots)) / d - 1.0) < 0.02
  assert abs(float(jnp.var(dots / np.sqrt(d))) - 1.0) < 0.02


def test_bad_arguments_are_rejected():
  q = jnp.zeros((1, 3, 3, 4))
  k = jnp.zeros((1, 3, 2, 4))
  with pytest.raises(ValueError, match='multiple of key/value heads'):
    attention.dot_product_attention(q, k, k)
  with pytest.raises(ValueError, match='valid'):
    attention.dot_product_attention(q, q, q, implementation='nope')


@pytest.mark.parametrize('num_kv_heads', [4, 2, 1])
def test_module_gqa_shares_heads_and_counts_parameters(num_kv_heads):
  d, n = 32, 4
  layer = attention.Attention(d, n, num_kv_heads, rngs=nnx.Rngs(0))
  h = d // n
  count = sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))
  assert count == 2 * d * d + 2 * d * num_kv_heads * h
  x = jax.random.normal(jax.random.key(0), (2, 6, d))
  q, k, v = layer.project(x)
  ref = naive(q, k, v, jnp.ones((2, n, 6, 6), bool))
  np.testing.assert_allclose(layer(x), layer.out(ref), atol=1e-5)
