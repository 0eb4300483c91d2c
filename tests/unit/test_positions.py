"""RoPE (+ PI/NTK/YaRN), ALiBi, T5 bias: golden values, defining properties, and in models."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from training import validation
from layers import options
from layers import positions
from layers import rope
from models import decoder_only
from models import stack
from tests.helpers import one_block_reference, quick_jit

jax.config.update('jax_default_matmul_precision', 'highest')

ALL = ['nope', 'sinusoidal', 'learned', 'rope', 'alibi', 't5_bias']


T5_BIDIRECTIONAL = [(0, 0), (-1, 1), (-7, 7), (-8, 8), (-11, 8), (-12, 9), (-16, 10), (-22, 10),
                    (-23, 11), (-32, 12), (-64, 14), (-127, 15), (-128, 15), (-1000, 15),
                    (1, 17), (7, 23), (8, 24), (16, 26), (100, 31), (1000, 31)]

T5_CAUSAL = [(0, 0), (5, 0), (100, 0), (-1, 1), (-15, 15), (-16, 16), (-20, 17), (-31, 21),
             (-32, 21), (-64, 26), (-100, 30), (-127, 31), (-128, 31), (-500, 31)]


def model_config(**overrides):
  cfg = validation.resolve(default.get_config()).model
  cfg.update(overrides)
  return cfg


def rotate(x, pos, **kw):
  """RoPE on `[B, T, N, H]` at `[B, T]` positions through the position object's hook."""
  obj = rope.RoPE(x.shape[-1], **kw)
  out, _, terms = obj.in_attention(x, x, pos, pos, is_causal=False)
  assert not terms
  return np.asarray(out, np.float64)


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _t5_bucket_py(rel, bidirectional, num_buckets, max_distance):
  """T5's rule in plain Python floats, for the reference below."""
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    bucket += num_buckets if rel > 0 else 0
    n = abs(rel)
  else:
    n = max(-rel, 0)
  exact = num_buckets // 2
  if n < exact:
    return bucket + n
  return bucket + min(exact + int(math.log(n / exact) / math.log(max_distance / exact)
                                  * (num_buckets - exact)), num_buckets - 1)


def rotations(theta, length):
  """Turns of frequency theta over a context of `length` tokens (YaRN's r)."""
  return length * theta / (2 * math.pi)


@pytest.mark.parametrize('fraction', [1.0, 0.5])
@pytest.mark.parametrize('scaling', ['none', 'pi', 'ntk', 'yarn'])
def test_rope_scores_depend_only_on_relative_position(fraction, scaling):
  h = 16
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, h))  # [1, 1, 1, H] each
  starts = np.array([0, 3, 17, 250])
  kw = dict(fraction=fraction, scaling=scaling, factor=4.0, original_max_length=32)
  for delta in (0, 1, 5, -9, 40):
    qr = rotate(jnp.broadcast_to(q, (1, 4, 1, h)), jnp.asarray(starts)[None], **kw)  # [1, 4, 1, H]
    kr = rotate(jnp.broadcast_to(k, (1, 4, 1, h)), jnp.asarray(starts + delta)[None], **kw)
    dots = np.sum(qr * kr, axis=-1)[0, :, 0]  # [4]: <R(i) q, R(i + delta) k> for each start i
    np.testing.assert_allclose(dots, dots[0], atol=2e-4)
  # And it does depend on the offset (otherwise the test above proves nothing).
  qr = rotate(q, jnp.zeros((1, 1), jnp.int32), **kw)
  far = rotate(k, jnp.full((1, 1), 3), **kw)
  near = rotate(k, jnp.zeros((1, 1), jnp.int32), **kw)
  assert abs(np.sum(qr * far) - np.sum(qr * near)) > 1e-2


@pytest.mark.parametrize('scaling,factor,norm_scale', [
    ('none', 1.0, 1.0), ('pi', 4.0, 1.0), ('ntk', 4.0, 1.0),
    ('yarn', 4.0, 0.1 * math.log(4.0) + 1.0)])  # YaRN's temperature scales q and k
def test_rope_preserves_norm(scaling, factor, norm_scale):
  x = jax.random.normal(jax.random.key(1), (2, 7, 3, 8))
  pos = jnp.array([[0, 1, 2, 3, 50, 51, 52], [9, 8, 7, 0, 1, 2, 1000]])
  out = rotate(x, pos, scaling=scaling, factor=factor, original_max_length=16)
  np.testing.assert_allclose(np.linalg.norm(out, axis=-1),
                             norm_scale * np.linalg.norm(np.asarray(x, np.float64), axis=-1),
                             rtol=1e-5)


def test_rope_partial_fraction_leaves_the_other_dims_unchanged():
  x = jax.random.normal(jax.random.key(2), (1, 5, 2, 16))
  pos = jnp.arange(5)[None] * 7
  out = rotate(x, pos, fraction=0.25)  # 4 of 16 dims rotated
  assert rope.rotary_dims(16, 0.25) == 4
  np.testing.assert_array_equal(out[..., 4:], np.asarray(x)[..., 4:])
  assert not np.allclose(out[..., :4], np.asarray(x)[..., :4], atol=1e-2)
  # Position 0 is the identity.
  np.testing.assert_allclose(out[:, 0], np.asarray(x)[:, 0], atol=1e-6)


def test_rope_golden_rotation():
  # H = 4, rotate-half pairs (x0, x2) at theta_0 = 1 and (x1, x3) at theta_1 = 10000^(-1/2) = 0.01.
  x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
  out = rotate(x, jnp.array([[2]]))[0, 0, 0]
  c0, s0, c1, s1 = np.cos(2.0), np.sin(2.0), np.cos(0.02), np.sin(0.02)
  np.testing.assert_allclose(out, [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                                   4 * c1 + 2 * s1], atol=1e-6)


def test_rope_inverse_frequencies_match_their_formulas():
  d, base, s = 64, 10000.0, 4.0
  i = np.arange(d // 2)
  theta = base ** (-2.0 * i / d)
  np.testing.assert_allclose(rope.rope_inv_freq(d, base), theta, rtol=1e-12)
  np.testing.assert_allclose(positions.rope_inv_freq(d, base, 'pi', s), theta / s, rtol=1e-12)
  ntk = rope.rope_inv_freq(d, base, 'ntk', s)
  np.testing.assert_allclose(ntk, (base * s ** (d / (d - 2))) ** (-2.0 * i / d), rtol=1e-12)
  # NTK-aware: the highest frequency is kept, the lowest is interpolated exactly like PI.
  assert ntk[0] == 1.0 and np.isclose(ntk[-1], theta[-1] / s, rtol=1e-12)
  # YaRN with L = 2048: theta_i makes r_i = L theta_i / (2 pi) rotations over the context. The ramp
  # bounds are the indices where r = beta = 32 and r = alpha = 1:
  #   d ln(L / (32 * 2pi)) / (2 ln base) = 8.06 -> floor 8;
  #   d ln(L / 2pi) / (2 ln base) = 20.09 -> ceil 21.
  low, high = 8, 21
  assert rotations(theta[low], 2048) > 32 > rotations(theta[low + 1], 2048)
  ramp = np.clip((i - low) / (high - low), 0, 1)  # 0: keep theta, 1: theta / s
  yarn = rope.rope_inv_freq(d, base, 'yarn', s, original_max_length=2048)
  np.testing.assert_allclose(yarn, theta * (1 - ramp) + theta / s * ramp, rtol=1e-12)
  np.testing.assert_allclose(yarn[:9], theta[:9], rtol=1e-12)
  np.testing.assert_allclose(yarn[21:], theta[21:] / s, rtol=1e-12)
  assert rope.attention_factor('yarn', s) == pytest.approx(1.0 + 0.1 * math.log(4.0))
  assert rope.attention_factor('yarn', 1.0) == 1.0 and rope.attention_factor('pi', s) == 1.0
  # Factor 1 is the identity for every scaling.
  for name in rope.SCALINGS:
    np.testing.assert_allclose(rope.rope_inv_freq(d, base, name, 1.0, 2048), theta, rtol=1e-12)


def test_rope_scaling_is_set_on_a_built_model():
  cfg = model_config(num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32,
                     position='rope')
  model = decoder_only.DecoderOnly(cfg, vocab_size=11, max_length=8, rngs=nnx.Rngs(0))
  batch = {'inputs': jnp.array([[1, 5, 3, 9, 2, 7, 4, 6, 8, 10, 3, 1]])}  # 12 > 8 positions
  base_out = model(batch)
  assert positions.with_rope_scaling(model, 'pi', 2.0) is model
  assert (model.decoder.position.scaling, model.decoder.position.factor) == ('pi', 2.0)
  pi_out = model(batch)
  # Same parameters, built with the scaling in its config: the same numbers.
  cfg_pi = model_config(**{**cfg.to_dict(), 'rope_scaling': 'pi', 'rope_scaling_factor': 2.0})
  ref = decoder_only.DecoderOnly(cfg_pi, vocab_size=11, max_length=8, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(pi_out, ref(batch), atol=1e-6)
  assert not np.allclose(pi_out, base_out, atol=1e-3)
  # It reaches a jitted split/merge function too (the scaling is in the graph definition).
  graphdef, state = nnx.split(positions.with_rope_scaling(model, 'yarn', 2.0))
  yarn_out = quick_jit(lambda s, b: nnx.merge(graphdef, s)(b))(state, batch)
  assert not np.allclose(yarn_out, pi_out, atol=1e-3)
  positions.with_rope_scaling(model, 'none', 1.0)
  np.testing.assert_allclose(model(batch), base_out, atol=1e-6)
  with pytest.raises(ValueError, match='valid'):
    positions.with_rope_scaling(model, 'linear', 2.0)
  other = decoder_only.DecoderOnly(model_config(**{**cfg.to_dict(), 'position': 'alibi'}),
                                   vocab_size=11, max_length=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='no RoPE'):
    positions.with_rope_scaling(other, 'ntk', 2.0)


def test_alibi_slopes_golden():
  np.testing.assert_allclose(positions.alibi_slopes(8),
                             [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
  # 12 heads: the 8 slopes of 8 heads, then every other slope of 16 heads (2^-0.5, 2^-1, ...):
  # 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  np.testing.assert_allclose(positions.alibi_slopes(12), [
      0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625,
      0.7071067811865476, 0.3535533905932738, 0.1767766952966369, 0.08838834764831845],
      rtol=1e-12)
  np.testing.assert_allclose(positions.alibi_slopes(1), [1 / 256])


def test_alibi_passes_slopes_to_the_kernel():
  q = jnp.zeros((1, 3, 4, 8))
  q2, k2, terms = positions.ALiBi(4).in_attention(q, q, None, None, is_causal=True)
  assert q2 is q and k2 is q and terms.names() == ('alibi_slopes',)
  np.testing.assert_allclose(terms.alibi_slopes, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])


@pytest.mark.parametrize('bidirectional,table', [(True, T5_BIDIRECTIONAL), (False, T5_CAUSAL)])
def test_t5_buckets_golden(bidirectional, table):
  rel, want = np.array(table).T
  got = positions.t5_relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=32,
                                              max_distance=128)
  np.testing.assert_array_equal(got, want)


def test_t5_bias_is_a_table_lookup_per_head_from_positions():
  obj = positions.T5Bias(3, 16, num_buckets=8, max_distance=16, rngs=nnx.Rngs(0))
  q = jnp.zeros((2, 4, 3, 4))
  q_pos = np.array([[0, 1, 2, 3], [0, 1, 0, 1]])  # second row packed: positions restart
  _, _, terms = obj.in_attention(q, q, jnp.asarray(q_pos), jnp.asarray(q_pos), is_causal=False)
  bias = np.asarray(terms.bias)
  assert bias.shape == (2, 3, 4, 4)
  table = np.asarray(obj.table.embedding.value)  # [buckets, N]
  for b in range(2):
    for i in range(4):
      for j in range(4):
        bucket = _t5_bucket_py(int(q_pos[b, j] - q_pos[b, i]), True, 8, 16)
        np.testing.assert_allclose(bias[b, :, i, j], table[bucket])


@pytest.mark.parametrize('position', ALL)
def test_encoder_permutation_equivariant_only_without_positions(position):
  cfg = model_config(num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32,
                     position=position)
  enc = stack.Stack(cfg, vocab_size=20, max_length=16, rngs=nnx.Rngs(0))
  if position == 'learned':  # the default init is small; make positions matter visibly
    enc.position.table.embedding.value = jax.random.normal(jax.random.key(9), (16, 16))
  tokens = jnp.array([[3, 7, 1, 9, 4, 12, 5, 2]])
  perm = np.random.default_rng(0).permutation(8)
  out, out_perm = enc(tokens, is_causal=False), enc(tokens[:, perm], is_causal=False)
  diff = float(jnp.max(jnp.abs(out[:, perm] - out_perm)))
  if position == 'nope':
    assert diff < 1e-5
  else:
    assert diff > 1e-3


@pytest.mark.parametrize('position', ALL)
def test_decoder_only_forward_and_finite_gradient(position):
  """Smoke test with numbers: finite loss near ln V at init, finite non-zero gradient."""
  cfg = model_config(num_layers=2, d_model=16, num_heads=4, num_kv_heads=2, d_ff=32,
                     position=position)
  model = decoder_only.DecoderOnly(cfg, vocab_size=13, max_length=12, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(3), (2, 12), 1, 13)
  batch = {'inputs': tokens, 'segment_ids': jnp.array([[1] * 12, [1] * 5 + [2] * 7]),
           'positions': jnp.array([list(range(12)), list(range(5)) + list(range(7))])}

  graphdef, params = nnx.split(model)

  @quick_jit
  def loss_and_grad(params):
    def loss_fn(params):
      logp = jax.nn.log_softmax(nnx.merge(graphdef, params)(batch)[:, :-1])  # [B, T-1, V]
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return jax.value_and_grad(loss_fn)(params)

  loss, grads = loss_and_grad(params)
  leaves = jax.tree.leaves(grads)
  assert np.isfinite(float(loss)) and abs(float(loss) - math.log(13)) < 2.0
  assert all(np.all(np.isfinite(g)) for g in leaves)
  if position in ('learned', 't5_bias'):  # the position parameters themselves learn
    g = grads['decoder']['position']['table']['embedding'].value
    assert float(jnp.max(jnp.abs(g))) > 0


def test_t5_bucket_matches_plain_python_everywhere():
  rel = np.arange(-300, 301)
  for bidirectional in (True, False):
    got = positions.t5_relative_position_bucket(rel, bidirectional=bidirectional)
    np.testing.assert_array_equal(got, [_t5_bucket_py(int(r), bidirectional, 32, 128) for r in rel])


def _reference_attention(attn, x, pos, seg, position_obj, kind, is_causal):
  """float64 numpy self-attention with the position term written out per (i, j)."""
  wq = np.asarray(attn.query.kernel.value, np.float64)  # [D, N, H]
  wk = np.asarray(attn.key.kernel.value, np.float64)  # [D, K, H]
  wv = np.asarray(attn.value.kernel.value, np.float64)  # [D, K, H]
  wo = np.asarray(attn.out.kernel.value, np.float64)  # [N, H, D]
  n, kh, h = wq.shape[1], wk.shape[1], wq.shape[2]
  q = np.einsum('TD,DNH->TNH', x, wq)
  k = np.repeat(np.einsum('SD,DKH->SKH', x, wk), n // kh, axis=1)  # [S, N, H]: head n reads n // G
  v = np.repeat(np.einsum('SD,DKH->SKH', x, wv), n // kh, axis=1)
  t = x.shape[0]
  if kind == 'rope':
    theta = 10000.0 ** (-np.arange(0, h, 2) / h)

    def rot(p):  # R(p): block rotations of the pairs (i, i + H/2)
      r = np.eye(h)
      for i, w in enumerate(theta):
        c, s = np.cos(p * w), np.sin(p * w)
        r[i, i], r[i, i + h // 2], r[i + h // 2, i], r[i + h // 2, i + h // 2] = c, -s, s, c
      return r

    q = np.stack([q[i] @ rot(pos[i]).T for i in range(t)])
    k = np.stack([k[i] @ rot(pos[i]).T for i in range(t)])
  logits = np.einsum('TNH,SNH->NTS', q, k) / np.sqrt(h)
  for i in range(t):
    for j in range(t):
      if kind == 'alibi':
        logits[:, i, j] -= positions.alibi_slopes(n) * abs(pos[i] - pos[j])
      if kind == 't5_bias':
        bucket = _t5_bucket_py(int(pos[j] - pos[i]), not is_causal, 32, 128)
        logits[:, i, j] += np.asarray(position_obj.table.embedding.value)[bucket]
      if seg[i] != seg[j] or (is_causal and j > i):
        logits[:, i, j] = -np.inf
  probs = _softmax(logits)  # [N, T, S]
  return np.einsum('TNH,NHD->TD', np.einsum('NTS,SNH->TNH', probs, v), wo)


@pytest.mark.parametrize('is_causal', [True, False])
@pytest.mark.parametrize('kind', ['rope', 'alibi', 't5_bias'])
def test_one_layer_model_equals_hand_reference(kind, is_causal):
  # Two packed sequences in one row (segments, restarting positions) and GQA (4 query, 2 kv heads).
  cfg = model_config(num_layers=1, d_model=16, num_heads=4, num_kv_heads=2, d_ff=32,
                     position=kind)
  enc = stack.Stack(cfg, vocab_size=20, max_length=8, rngs=nnx.Rngs(0))
  tokens = jnp.array([[3, 7, 1, 9, 4, 12, 5, 2]])
  seg = np.array([1, 1, 1, 1, 1, 2, 2, 2])
  pos = np.array([0, 1, 2, 3, 4, 0, 1, 2])
  got = enc(tokens, segment_ids=jnp.asarray(seg)[None], positions=jnp.asarray(pos)[None],
            is_causal=is_causal)[0]
  want = one_block_reference(enc, tokens, lambda attn, x: _reference_attention(
      attn, x, pos, seg, enc.position, kind, is_causal))
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_config_validation_of_the_new_fields():
  config = validation.resolve(default.get_config())
  validation.validate(config)
  for field, value, match in [('rope_scaling', 'linear', 'rope_scaling'),
                              ('rope_scaling_factor', 0.0, 'rope_scaling_factor'),
                              ('rope_fraction', 1.5, 'rope_fraction'),
                              ('rope_base', 1.0, 'rope_base'),
                              ('t5_num_buckets', 7, 't5_num_buckets'),
                              ('t5_max_distance', 8, 't5_max_distance')]:
    bad = validation.resolve(default.get_config())
    bad.model[field] = value
    with pytest.raises(options.ConfigError, match=match):
      validation.validate(bad)
  bad = validation.resolve(default.get_config())
  bad.model.position, bad.model.rope_fraction = 'rope', 0.01  # head dim 32: no pair rotated
  with pytest.raises(options.ConfigError, match='rope_fraction'):
    validation.validate(bad)
