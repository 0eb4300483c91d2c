"""Sparse, low-rank and kernelised attention variants: exact against explicit masks, approximations
improve where they should, impossible configs are rejected in one line (that every variant trains
is in tests/integration/test_attention_variants.py)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from training import validation
from layers import attention
from layers import attention_variants
from layers import attention_xla
from layers import linear_attention
from layers import masks
from layers import options
from layers import sparse_attention
from tests.helpers import quick_jit

D, N, K, T = 16, 4, 2, 13  # T not a multiple of any block below; N/K = 2 (GQA)


MASKING = {
    'sliding_window': dict(window=3, block=4),
    'longformer': dict(window=2, global_tokens=(0, 6), block=4),
    'bigbird': dict(block=3, num_random=1, global_tokens=(0,), seed=1),
}

CAUSAL = ('sliding_window', 'longformer', 'bigbird', 'performer', 'linear')


def _layer(name, **kwargs):
  rngs = nnx.Rngs(params=0)
  cls = attention_variants.VARIANTS[name]
  return cls(D, N, K, rngs=rngs, **kwargs)


def _segments():
  # Row 0: one sequence then padding (id 0); row 1: two packed segments.
  return jnp.asarray([[1] * 10 + [0] * 3, [1] * 6 + [2] * 7], jnp.int32)


@pytest.mark.parametrize('is_causal', [False, True], ids=['encoder', 'decoder'])
@pytest.mark.parametrize('name', sorted(MASKING))
def test_masking_variant_equals_dense_with_explicit_mask(name, is_causal):
  """The kernel with padding and packed segments, forward and gradient; the layer without."""
  layer = _layer(name, **MASKING[name])
  pattern = layer.pattern(T, is_causal)
  seg = _segments()
  mask = sparse_attention.reference_mask(pattern, T, is_causal=is_causal, segment_ids=seg)
  qkv = [jax.random.normal(k, (2, T, n, 8)) for k, n in zip(jax.random.split(jax.random.key(0), 3),
                                                             (N, K, K))]
  scale = 8 ** -0.5

  def blocked(q, k, v):
    return sparse_attention.sparse_attention(q, k, v, pattern, scale=scale, block=layer.block,
                                             is_causal=is_causal, q_segment_ids=seg,
                                             kv_segment_ids=seg)

  def dense(q, k, v):
    return attention_xla.attention(q, k, v, mask=mask, scale=scale)

  w = jax.random.normal(jax.random.key(1), (2, T, N, 8))  # a random cotangent

  @quick_jit  # one compilation per case instead of one per eager op (the CPU is slow and shared)
  def outputs_and_grads(*qkv):
    return [jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * w),
                               argnums=(0, 1, 2))(*qkv) + (fn(*qkv),)
            for fn in (blocked, dense)]

  (_, g_blocked, o_blocked), (_, g_dense, o_dense) = outputs_and_grads(*qkv)
  np.testing.assert_allclose(o_blocked, o_dense, atol=1e-5, rtol=1e-5)
  for a, b in zip(g_blocked, g_dense):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
  # The layer (projections around the kernel) gives the same numbers as its explicit-mask weights.
  x = jax.random.normal(jax.random.key(2), (2, T, D))

  @quick_jit
  def layer_and_reference(x):
    out = layer(x, is_causal=is_causal)
    _, _, v = layer.project(x)
    probs = layer.weights(x, is_causal=is_causal)  # [B, N, T, S]
    return out, layer.out(jnp.einsum('BNTS,BSNH->BTNH', probs, jnp.repeat(v, N // K, axis=2)))

  np.testing.assert_allclose(*layer_and_reference(x), atol=1e-5, rtol=1e-5)


def test_masking_patterns_are_what_the_papers_say():
  # Sliding window: decoder sees i - w..i; Longformer: the global row/column are full.
  sw = np.asarray(sparse_attention.reference_mask(masks.SparsePattern(window=(2, 2)), 6,
                                                  is_causal=True))[0, 0]
  assert sw[5].tolist() == [False, False, False, True, True, True]
  lf = np.asarray(sparse_attention.reference_mask(
      masks.SparsePattern(window=(1, 1), global_tokens=(0,)), 6))[0, 0]
  assert lf[0].all() and lf[:, 0].all() and lf[5].tolist() == [True] + [False] * 3 + [True] * 2
  # BigBird: each query block gets its random blocks, outside its band, fixed by the seed.
  rand = sparse_attention.bigbird_random_blocks(8, 2, 1, False, seed=3)
  assert rand == sparse_attention.bigbird_random_blocks(8, 2, 1, False, seed=3)
  for i, row in enumerate(rand):
    assert len(set(row)) == 2 and all(abs(i - j) > 1 for j in row)


def _numpy_sliding_window(q, k, v, w, causal):
  """The chapter's reference: window mask, scaled scores, -inf outside, subtract row max,
  normalise."""
  n, d = q.shape
  i, j = np.arange(n)[:, None], np.arange(n)[None, :]
  mask = (np.abs(i - j) <= w) & ((j <= i) if causal else True)
  scores = q @ k.T / np.sqrt(d)
  scores = np.where(mask, scores, -np.inf)
  scores = scores - scores.max(axis=-1, keepdims=True)
  weights = np.exp(scores)
  weights = weights / weights.sum(axis=-1, keepdims=True)
  return weights @ v


@pytest.mark.parametrize('causal', [False, True])
def test_sliding_window_reproduces_the_numpy_reference(causal):
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3))  # seq 8, d 4
  want = _numpy_sliding_window(q, k, v, 2, causal)
  got = sparse_attention.sparse_attention(
      q[None, :, None], k[None, :, None], v[None, :, None], masks.SparsePattern(window=(2, 2)),
      scale=4 ** -0.5, block=3, is_causal=causal)[0, :, 0]
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_sliding_window_changes_the_output_only_beyond_the_window():
  layer = _layer('sliding_window', window=2, block=4)
  x = jax.random.normal(jax.random.key(0), (1, T, D))
  far = x.at[:, 12].add(5.0)  # token 12 is more than 2 positions from every query 0..9
  a, b = layer(x), layer(far)
  np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
  assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-3


def test_unscaled_dense_uses_scale_one():
  cfg = validation.resolve(default.get_config('quick')).model
  cfg.unscaled = True
  layer = attention.Attention.from_config(cfg, rngs=nnx.Rngs(params=0))
  x = jax.random.normal(jax.random.key(0), (1, 5, cfg.d_model))
  q, k, v = layer.project(x)
  want = layer.out(attention.dot_product_attention(q, k, v, scale=1.0))
  np.testing.assert_allclose(layer(x), want, atol=1e-5)
  assert np.abs(layer(x) - layer.out(attention.dot_product_attention(q, k, v))).max() > 1e-4


def _softmax_attention(q, k, v, causal=False):
  return attention_xla.attention(q, k, v, scale=q.shape[-1] ** -0.5, is_causal=causal)


def test_performer_error_falls_with_more_features():
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, 32, 1, 16)) * s for key, s in zip(keys, (0.5, 0.5, 1.0)))
  exact = _softmax_attention(q, k, v)

  @quick_jit
  def error(w):
    qf, kf = linear_attention.performer_features(q[:, :, :, None], k, w, 16 ** -0.5)
    approx = linear_attention.kernel_attention(qf, kf, v)[:, :, :, 0]
    return jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact)

  errors = {m: float(np.mean([error(linear_attention.orthogonal_features_np(seed, m, 16))
                              for seed in range(8)]))  # averaged over 8 feature draws
            for m in (16, 64, 256)}
  print('performer relative error by features:', errors)
  assert errors[16] > errors[64] > errors[256], errors
  assert errors[256] < 0.5 * errors[16], errors


@pytest.mark.parametrize('name', ['performer', 'linear'])
def test_causal_kernel_attention_equals_its_quadratic_masked_form(name):
  layer = _layer(name)
  x = jax.random.normal(jax.random.key(0), (2, T, D))
  seg = jnp.asarray([[1] * T, [1] * 9 + [0] * 4], jnp.int32)

  @quick_jit
  def both(x):
    qf, kf, v = layer._features(x, None, seg, None, None, None, True)
    recurrent = linear_attention.kernel_attention(qf, kf, v, is_causal=True, chunk=4)
    probs = layer.weights(x, segment_ids=seg, is_causal=True)  # [B, N, T, S], quadratic
    quadratic = jnp.einsum('BNTS,BSNH->BTNH', probs, jnp.repeat(v, N // K, axis=2))
    return recurrent.reshape(quadratic.shape), quadratic, layer(x, is_causal=True)

  recurrent, quadratic, out = both(x)
  np.testing.assert_allclose(recurrent, quadratic, atol=1e-5, rtol=1e-5)
  # Causal: a later token does not change earlier outputs.
  np.testing.assert_allclose(out[:, :8], both(x.at[:, 8].add(3.0))[2][:, :8], atol=1e-5)


def test_linear_bidirectional_equals_its_quadratic_form_and_linformer_is_low_rank():
  layer = _layer('linear')
  x = jax.random.normal(jax.random.key(0), (2, T, D))
  qf, kf, v = layer._features(x, None, None, None, None, None, False)
  out = linear_attention.kernel_attention(qf, kf, v)
  probs = layer.weights(x)
  want = jnp.einsum('BNTS,BSNH->BTNH', probs, jnp.repeat(v, N // K, axis=2))
  np.testing.assert_allclose(out.reshape(want.shape), want, atol=1e-5, rtol=1e-5)
  lin = _layer('linformer', k=5, max_length=16)
  assert lin.weights(x).shape == (2, N, T, 5)
  with pytest.raises(ValueError, match='not causal'):
    lin(x, is_causal=True)


@pytest.mark.parametrize('overrides,field', [
    (dict(arch='decoder_only', attention='linformer'), 'model.attention'),
    (dict(arch='encoder_decoder', attention='linformer'), 'model.attention'),
    (dict(attention='sliding_window', window=-1), 'model.window'),
    (dict(attention='longformer', global_tokens=tuple(range(80))), 'model.global_tokens'),
    (dict(attention='bigbird', global_tokens=(0, 64)), 'model.global_tokens'),
    (dict(attention='performer', performer_redraw=-1), 'model.performer_redraw'),
    (dict(attention='longformer', position='alibi'), 'model.position'),
])
def test_impossible_combinations_are_one_line_config_errors(overrides, field):
  config = validation.resolve(default.get_config())
  config.model.update(overrides)
  with pytest.raises(options.ConfigError, match=field.replace('.', r'\.')) as e:
    validation.validate(config)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('is_causal', [False, True])
def test_performer_queries_and_keys_of_large_norm_keep_finite_gradients(is_causal):
  """|x|²/2 sits inside the stabilising max: a row of norm 16 (|x|²/2 = 128 > float32's exp range)
  keeps a feature of exactly 1/sqrt(M) instead of underflowing to 0, and the normaliser's gradient
  stays finite (it was NaN from about step 150 of the attention-variants study)."""
  b, t, k, h, m = 1, 6, 1, 8, 16
  w = jnp.asarray(linear_attention.orthogonal_features_np(0, m, h))
  q, kk, v = (jax.random.normal(jax.random.key(i), (b, t, k, h)) for i in range(3))
  big = q.at[:, 2].multiply(16.0 / jnp.linalg.norm(q[:, 2], axis=-1, keepdims=True))
  qf = linear_attention.favor_features(big[:, :, :, None], w, stabilise_axes=(-1,))
  np.testing.assert_allclose(jnp.max(qf, -1), 1 / np.sqrt(m), rtol=1e-6)

  def loss(q, kk, v):
    qf, kf = linear_attention.performer_features(q[:, :, :, None], kk, w, 1.0)
    return jnp.sum(linear_attention.kernel_attention(qf, kf, v, is_causal=is_causal) ** 2)

  grads = quick_jit(jax.grad(loss, argnums=(0, 1, 2)))(big, kk.at[:, 3].multiply(6.0), v)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize('is_causal', [False, True])
def test_kernel_attention_with_a_vanishing_denominator_has_finite_gradients(is_causal):
  """A query whose visible keys' features nearly underflowed (den ~ 1e-26) gets zeros and a
  zero gradient: the quotient's den^-2 would overflow float32 to inf and NaN."""
  b, t, k, m, h = 1, 5, 1, 4, 3
  qf = jnp.full((b, t, k, 1, m), 0.5)
  kf = jnp.full((b, t, k, m), 0.5).at[:, :2].set(1e-26)  # keys 0, 1: nearly underflowed
  v = jax.random.normal(jax.random.key(0), (b, t, k, h))

  def loss(qf, kf, v):
    return jnp.sum(linear_attention.kernel_attention(qf, kf, v, is_causal=is_causal) ** 2)

  grads = quick_jit(jax.grad(loss, argnums=(0, 1, 2)))(qf, kf, v)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  out = quick_jit(lambda *a: linear_attention.kernel_attention(*a, is_causal=is_causal))(qf, kf, v)
  if is_causal:  # queries 0 and 1 see only the denormal keys
    np.testing.assert_array_equal(out[:, :2], 0.0)
