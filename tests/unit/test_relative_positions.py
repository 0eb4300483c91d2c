"""FIRE, KERPLE, xPos and randomized positions: float64 references, defining properties, kernels,
cached decoding and config checks."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from configs import extrapolation as extrapolation_config
from layers import attention
from layers import attention_blockwise
from layers import options
from layers import positions
from layers import relative_bias
from layers import rope
from models import stack
from tests.helpers import jitted_forward, one_block_reference, quick_jit
from training import extrapolation
from training import validation

jax.config.update('jax_default_matmul_precision', 'highest')

NEW = ['fire', 'kerple', 'xpos']
V = 23


def model_config(**overrides):
  config = default.get_config()
  config.model.update(**overrides)
  config = validation.resolve(config)
  validation.validate(config)
  return config.model


def _softmax(x):
  x = x - np.max(x, -1, keepdims=True)
  e = np.exp(x)
  return e / np.sum(e, -1, keepdims=True)


def _fire_reference(p, qpos, kpos):
  """FIRE in float64 from the formula: f(log(c|i-j|+1) / (log(c max(L, i)+1) + eps))."""
  c = float(p['c'])
  threshold = abs(float(p['threshold']) * float(p['init_threshold']))
  out = np.zeros((np.asarray(p['b2']).shape[0], len(qpos), len(kpos)))
  for a, i in enumerate(qpos):
    for b, j in enumerate(kpos):
      x = math.log(abs(c * abs(i - j)) + 1) / (math.log(abs(c * max(threshold, i)) + 1) + 1e-6)
      hidden = np.maximum(x * np.asarray(p['w1'], np.float64) + np.asarray(p['b1'], np.float64), 0)
      out[:, a, b] = hidden @ np.asarray(p['w2'], np.float64) + np.asarray(p['b2'], np.float64)
  return out


def _kerple_reference(p, qpos, kpos):
  r1 = np.maximum(np.asarray(p['r1'], np.float64), 0.01)
  r2 = np.maximum(np.asarray(p['r2'], np.float64), 0.01)
  dist = np.abs(np.asarray(qpos)[:, None] - np.asarray(kpos)[None, :]).astype(np.float64)
  return -r1[:, None, None] * np.log1p(r2[:, None, None] * dist)


def _xpos_matrix(p, h, centre, sign):
  """R(p) times the xPos scale, on pairs (i, i + H/2), in float64."""
  theta = 10000.0 ** (-np.arange(0, h, 2) / h)
  zeta = (np.arange(0, h, 2) + 0.4 * h) / (1.4 * h)
  r = np.eye(h)
  for i, w in enumerate(theta):
    c, s = np.cos(p * w), np.sin(p * w)
    f = zeta[i] ** (sign * (p - centre) / 512.0)
    r[i, i], r[i, i + h // 2], r[i + h // 2, i], r[i + h // 2, i + h // 2] = (
        c * f, -s * f, s * f, c * f)
  return r


def _reference_layer(attn, x, pos, seg, position_obj, kind, is_causal):
  """One attention layer in float64: q/k/v from the layer's weights, the method from its formula."""
  wq, wk, wv, wo = (np.asarray(m.kernel[...], np.float64)
                    for m in (attn.query, attn.key, attn.value, attn.out))
  n, h = wq.shape[1], wq.shape[2]
  kh = wk.shape[1]
  q = np.einsum('TD,DNH->TNH', x, wq)
  k = np.repeat(np.einsum('SD,DKH->SKH', x, wk), n // kh, axis=1)  # [S, N, H]
  v = np.repeat(np.einsum('SD,DKH->SKH', x, wv), n // kh, axis=1)
  t = x.shape[0]
  if kind == 'xpos':
    q = np.stack([q[i] @ _xpos_matrix(pos[i], h, position_obj.centre, 1).T for i in range(t)])
    k = np.stack([k[i] @ _xpos_matrix(pos[i], h, position_obj.centre, -1).T for i in range(t)])
  logits = np.einsum('TNH,SNH->NTS', q, k) / np.sqrt(h)
  params = position_obj.bias_params() if kind in ('fire', 'kerple') else None
  if kind == 'fire':
    logits += _fire_reference(params, pos, pos)
  if kind == 'kerple':
    logits += _kerple_reference(params, pos, pos)
  for i in range(t):
    for j in range(t):
      if seg[i] != seg[j] or (is_causal and j > i):
        logits[:, i, j] = -np.inf
  probs = _softmax(logits)  # [N, T, S]
  return np.einsum('TNH,NHD->TD', np.einsum('NTS,SNH->TNH', probs, v), wo)


@pytest.mark.parametrize('impl', ['xla', 'blockwise'])
@pytest.mark.parametrize('is_causal', [True, False])
@pytest.mark.parametrize('kind', NEW)
def test_one_layer_model_equals_float64_reference(kind, is_causal, impl, monkeypatch):
  # Two packed sequences in one row (positions restart), GQA (4 query, 2 kv heads), and a FIRE
  # threshold of 3 so that the progressive interpolation acts within the row.
  cfg = model_config(num_layers=1, d_model=16, num_heads=4, num_kv_heads=2, d_ff=32,
                     position=kind, attention_impl=impl, fire_threshold=3.0)
  enc = stack.Stack(cfg, vocab_size=20, max_length=8, rngs=nnx.Rngs(0))
  # Blockwise tiles of 3 x 3 on a row of 8: the per-tile bias path, padding and the bands.
  monkeypatch.setitem(attention.KERNELS, 'blockwise', dataclasses.replace(
      attention.KERNELS['blockwise'],
      fn=functools.partial(attention_blockwise.attention, block_q=3, block_k=3)))
  tokens = jnp.array([[3, 7, 1, 9, 4, 12, 5, 2]])
  seg = np.array([1, 1, 1, 1, 1, 2, 2, 2])
  pos = np.array([0, 1, 2, 3, 4, 0, 1, 2])
  got = enc(tokens, segment_ids=jnp.asarray(seg)[None], positions=jnp.asarray(pos)[None],
            is_causal=is_causal)[0]
  want = one_block_reference(enc, tokens, lambda attn, x: _reference_layer(
      attn, x, pos, seg, enc.position, kind, is_causal))
  np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize('kind', ['fire', 'kerple'])
def test_bias_function_equals_float64_formula(kind):
  cls = positions.POSITIONS[kind]
  obj = cls(4, threshold=5.0, rngs=nnx.Rngs(1)) if kind == 'fire' else cls(4, rngs=nnx.Rngs(1))
  qpos, kpos = np.arange(40), np.arange(40)
  got = np.asarray(relative_bias.PositionBias(
      cls.fn, obj.bias_params(), jnp.asarray(qpos)[None], jnp.asarray(kpos)[None]).dense()[0])
  want = (_fire_reference if kind == 'fire' else _kerple_reference)(obj.bias_params(), qpos, kpos)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)


def test_kerple_bias_depends_only_on_distance():
  obj = positions.KERPLE(4, rngs=nnx.Rngs(2))
  pb = lambda q, k: relative_bias.PositionBias(obj.fn, obj.bias_params(), jnp.asarray(q)[None],
                                               jnp.asarray(k)[None]).dense()[0]
  q, k = np.arange(10, 20), np.arange(0, 16)
  np.testing.assert_allclose(pb(q, k), pb(q + 37, k + 37), atol=1e-6)
  assert np.all(np.diff(np.asarray(pb([15], np.arange(16)))[:, 0, ::-1], axis=-1) < 0)  # decays


def test_fire_is_relative_below_the_threshold_and_interpolates_above_it():
  obj = positions.FIRE(4, threshold=20.0, rngs=nnx.Rngs(3))
  pb = lambda q, k: np.asarray(relative_bias.PositionBias(
      obj.fn, obj.bias_params(), jnp.asarray(q)[None], jnp.asarray(k)[None]).dense()[0])
  # Below L the normaliser is psi(L) for every query: the bias is a function of i - j only.
  np.testing.assert_allclose(pb(np.arange(5, 12), np.arange(0, 8)),
                             pb(np.arange(5, 12) + 8, np.arange(0, 8) + 8), atol=1e-6)
  # Above L, b(i, j) = f(psi(i - j) / psi(i)): the first key is always at input 1 (f(1)), so its
  # bias is the same at every query past L, while a fixed distance moves towards f(0).
  first = pb(np.array([25, 60, 300, 2000]), np.array([0]))[:, :, 0]  # [N, 4]
  np.testing.assert_allclose(first, np.repeat(first[:, :1], 4, axis=1), atol=1e-5)
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(pb(np.array([25]), np.array([20])),
                               pb(np.array([2000]), np.array([1995])), atol=1e-5)


@pytest.mark.parametrize('shift', [1, 7, 5000])
def test_xpos_scores_depend_only_on_relative_position(shift):
  # Large absolute positions too: the centred exponents keep q and k finite in float32.
  xp = rope.XPos(16, centre=32)
  q = jax.random.normal(jax.random.key(0), (1, 6, 2, 16))
  k = jax.random.normal(jax.random.key(1), (1, 6, 2, 16))
  pos = jnp.array([[0, 1, 2, 5, 9, 20]])

  def scores(p):
    qr, kr, _ = xp.in_attention(q, k, p, p, is_causal=True)
    return jnp.einsum('BTNH,BSNH->BNTS', qr, kr)

  np.testing.assert_allclose(scores(pos + shift), scores(pos), rtol=2e-4, atol=2e-4)


def test_xpos_decay_golden():
  # zeta_i = (2i + 0.4 d) / (1.4 d): torchscale's XPOS buffer `scale` for d = 8.
  np.testing.assert_allclose(rope.xpos_zeta(8), [3.2 / 11.2, 5.2 / 11.2, 7.2 / 11.2, 9.2 / 11.2])
  # A query at n and a key at m: each pair of q.k gains zeta^((n - m) / 512).
  xp = rope.XPos(8, centre=0)
  q = jnp.zeros((1, 1, 1, 8)).at[..., 0].set(1.0)
  k = jnp.zeros((1, 1, 1, 8)).at[..., 0].set(1.0)
  qr, _, _ = xp.in_attention(q, q, jnp.array([[0]]), jnp.array([[0]]), is_causal=True)
  _, kr, _ = xp.in_attention(k, k, jnp.array([[100]]), jnp.array([[100]]), is_causal=True)
  _, kr0, _ = xp.in_attention(k, k, jnp.array([[0]]), jnp.array([[0]]), is_causal=True)
  # Same rotation of k at 100 versus at 0 apart, the score's magnitude carries zeta_0^(-100/512).
  ratio = jnp.linalg.norm(kr[..., 0::4]) / jnp.linalg.norm(kr0[..., 0::4])
  np.testing.assert_allclose(ratio, (3.2 / 11.2) ** (-100 / 512), rtol=1e-5)
  assert float(qr[0, 0, 0, 0]) == pytest.approx(1.0)


@pytest.mark.parametrize('kind', ['fire', 'kerple'])
def test_blockwise_equals_xla_forward_and_gradient(kind):
  cls = positions.POSITIONS[kind]
  obj = cls(4, threshold=6.0, rngs=nnx.Rngs(0)) if kind == 'fire' else cls(4, rngs=nnx.Rngs(0))
  b, t = 2, 13
  q = jax.random.normal(jax.random.key(1), (b, t, 4, 8))
  k = jax.random.normal(jax.random.key(2), (b, t, 2, 8))
  v = jax.random.normal(jax.random.key(3), (b, t, 2, 8))
  pos = jnp.array([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5], list(range(3, 16))])  # per row

  def loss(params, q, k, v, impl, **kw):
    pb = relative_bias.PositionBias(cls.fn, params, pos, pos)
    out = attention.KERNELS[impl].fn(q, k, v, scale=0.3, is_causal=True, position_bias=pb, **kw)
    return jnp.sum(out * jnp.cos(out)), out

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
  (_, want), gwant, (_, got), ggot = quick_jit(  # one compilation, not one per eager op
      lambda *a: grad(*a, 'xla') + grad(*a, 'blockwise', block_q=4, block_k=4))(
          obj.bias_params(), q, k, v)
  np.testing.assert_allclose(got, want, atol=2e-6)
  for a, c in zip(jax.tree.leaves(ggot), jax.tree.leaves(gwant)):
    np.testing.assert_allclose(a, c, atol=1e-5, rtol=1e-5)
  assert float(jnp.max(jnp.abs(jax.tree.leaves(gwant[0])[0]))) > 0  # the parameters learn


def full_and_cached_logits(model, tokens):
  graphdef, params = nnx.split(model)

  @quick_jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache({'inputs': tokens}, tokens.shape[1] + 3)

    def step(cache, t):
      logits, cache = model.decode_step(cache, tokens[:, t], t)
      return cache, logits

    _, steps = jax.lax.scan(step, cache, jnp.arange(tokens.shape[1]))
    return model({'inputs': tokens}), steps.swapaxes(0, 1)

  return run(params, tokens)


@pytest.mark.parametrize('impl', ['xla', 'blockwise'])
@pytest.mark.parametrize('kind', NEW)
def test_decoder_cache_equals_full_forward(kind, impl):
  cfg = model_config(arch='decoder_only', position=kind, num_layers=2, d_model=32, num_heads=4,
                     num_kv_heads=2, d_ff=64, attention_impl=impl, fire_threshold=4.0)
  model = models.build(cfg, V, 16, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  full, step = full_and_cached_logits(model, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('kind', ['fire', 'kerple'])
def test_learned_bias_refused_by_kernels_that_cannot_take_it(kind):
  for impl in ('pallas', 'cudnn', 'ring'):
    with pytest.raises(options.ConfigError,
                       match=f"model.position='{kind}'.*attention_impl='{impl}'.*blockwise, xla"):
      model_config(position=kind, attention_impl=impl)
  pb = relative_bias.PositionBias(relative_bias.kerple_log_bias,
                                  {'r1': jnp.ones(2), 'r2': jnp.ones(2)},
                                  jnp.arange(4)[None], jnp.arange(4)[None])
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="implementation='pallas' cannot take a learned bias "
                                      "function of the positions, evaluated per tile; valid: "
                                      "blockwise, xla$"):
    attention.dot_product_attention(q, q, q, implementation='pallas', position_bias=pb)


def test_config_checks_of_the_new_fields():
  for field, value, match in [('fire_mlp_width', 0, 'fire_mlp_width'),
                              ('fire_threshold', -1.0, 'fire_threshold'),
                              ('xpos_scale_base', 0.0, 'xpos_scale_base'),
                              ('random_positions_max', -1, 'random_positions_max')]:
    bad = validation.resolve(default.get_config())
    bad.model[field] = value
    with pytest.raises(options.ConfigError, match=match):
      validation.validate(bad)
  bad = validation.resolve(default.get_config())
  bad.model.position, bad.model.random_positions_max = 'alibi', 256
  with pytest.raises(options.ConfigError, match='random_positions_max=256 needs model.position'):
    validation.validate(bad)
  bad.model.position, bad.model.random_positions_max = 'rope', 32  # < data.max_length = 64
  with pytest.raises(options.ConfigError, match='must be >= data.max_length=64'):
    validation.validate(bad)
  bad.model.random_positions_max = 256
  validation.validate(bad)
  bad.model.update(position='xpos', random_positions_max=0, xpos_block=64, attention_impl='ring')
  with pytest.raises(options.ConfigError,
                     match=r"model.position='xpos' adds a \[T, S\] mask, which "
                           r"model.attention_impl='ring' cannot take; valid values: blockwise, "
                           r"cudnn, pallas, xla \(or model.position in: "
                           r"alibi, learned, nope, rope, "
                           r"sinusoidal\)$"):
    validation.validate(bad)
  bad.model.xpos_block = -1
  with pytest.raises(options.ConfigError, match='xpos_block=-1 must be an integer >= 0'):
    validation.validate(bad)


def test_random_positions_are_sorted_distinct_draws_and_keep_segments_in_order():
  pos = jnp.array([list(range(12)), [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])
  out = np.asarray(positions.random_positions(jax.random.key(0), pos, 100))
  assert out.min() >= 0 and out.max() < 100
  assert np.all(np.diff(out[0]) > 0)  # a whole row: strictly increasing, so distinct
  for start, end in [(0, 4), (4, 7), (7, 12)]:  # each packed segment increasing
    assert np.all(np.diff(out[1, start:end]) > 0)
  assert not np.array_equal(out[0], np.arange(12))
  other = np.asarray(positions.random_positions(jax.random.key(1), pos, 100))
  assert not np.array_equal(out, other)  # a new draw per key (per step)


@pytest.mark.parametrize('position', positions.RANDOM_POSITIONS)
def test_random_positions_only_in_training(position):
  cfg = model_config(arch='decoder_only', position=position, num_layers=1, d_model=16,
                     num_heads=2, d_ff=32, random_positions_max=128)
  model = models.build(cfg, V, 64, rngs=nnx.Rngs(0))
  if position == 'learned':
    assert model.decoder.position.table.embedding.shape[0] == 128  # every drawable id has a row
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 1, V)
  batch = {'inputs': tokens}
  evaluation = model(batch)
  np.testing.assert_allclose(evaluation, model(dict(batch, positions=jnp.broadcast_to(
      jnp.arange(10), (2, 10)))), atol=1e-6)  # evaluation: positions 0..T-1
  train = model(batch, rngs=nnx.Rngs(dropout=0))
  assert float(jnp.max(jnp.abs(train - evaluation))) > 1e-3
  # The training draw is the documented one: the same logits from the drawn positions.
  drawn = positions.random_positions(nnx.Rngs(dropout=0).dropout(),
                                     jnp.broadcast_to(jnp.arange(10), (2, 10)), 128)
  np.testing.assert_allclose(train, model(dict(batch, positions=drawn)), atol=1e-5)


def test_xpos_blockwise_causal_mask_golden():
  # w = 4: queries 0-3 see every earlier key, 4-7 keys from 0, 8-11 keys from 4
  # (own block + previous).
  pos = jnp.arange(12)[None]
  mask = np.asarray(rope.blockwise_causal_mask(pos, pos, 4))[0, 0]  # [T, S]
  first = [int(np.argmax(row)) for row in mask]
  assert first == [0] * 8 + [4] * 4
  assert mask[11, 4] and not mask[11, 3] and mask[7, 0]


@pytest.mark.parametrize('impl', ['xla', 'blockwise'])
def test_xpos_blockwise_causal_attention_in_models(impl):
  base = dict(arch='decoder_only', position='xpos', num_layers=2, d_model=32, num_heads=4,
              num_kv_heads=2, d_ff=64, attention_impl=impl)
  plain = models.build(model_config(**base), V, 16, rngs=nnx.Rngs(0))
  bca = models.build(model_config(**base, xpos_block=4), V, 16, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 11), 1, V)
  # Within one block pair (T <= 2w, as in training with w = L) it is plain causal attention.
  plain_forward = jitted_forward(plain)
  np.testing.assert_allclose(jitted_forward(bca)({'inputs': tokens[:, :8]}),
                             plain_forward({'inputs': tokens[:, :8]}), atol=1e-6)
  full_bca, step_bca = full_and_cached_logits(bca, tokens)
  assert float(jnp.max(jnp.abs(full_bca - plain_forward({'inputs': tokens})))) > 1e-4  # differs
  np.testing.assert_allclose(step_bca, full_bca, atol=2e-5, rtol=2e-5)  # and decodes the same


def test_xpos_block_with_a_variant_without_scores_is_refused_at_validation():
  """The blockwise causal form is a [T, S] mask: refused before compilation for the variants that
  take no score terms (it was refused only when the model ran)."""
  from configs import default
  from training import validation
  config = validation.resolve(default.get_config())
  config.model.update({'position': 'xpos', 'xpos_block': 16, 'attention': 'sliding_window'})
  with pytest.raises(options.ConfigError,
                     match=r"^model.position='xpos' adds a \[T, S\] mask to the scores, which "
                           r"model.attention='sliding_window' does not take; valid values: "):
    validation.validate(config)
  config.model.xpos_block = 0
  validation.validate(config)


def test_with_xpos_block_turns_the_blockwise_window_off_and_on():
  """eval.py --xpos_block: a model trained with blocks of 4 evaluated with 0 is the plain causal
  model (same parameters), and a plain one given 4 is the blockwise one; no xPos: one line."""
  base = dict(arch='decoder_only', position='xpos', num_layers=1, d_model=16, num_heads=2,
              d_ff=32)
  plain = models.build(model_config(**base), V, 16, rngs=nnx.Rngs(0))
  bca = models.build(model_config(**base, xpos_block=4), V, 16, rngs=nnx.Rngs(0))
  tokens = {'inputs': jax.random.randint(jax.random.key(1), (2, 11), 1, V)}
  want_plain, want_bca = jitted_forward(plain)(tokens), jitted_forward(bca)(tokens)
  positions.with_xpos_block(bca, 0)
  positions.with_xpos_block(plain, 4)
  np.testing.assert_array_equal(jitted_forward(bca)(tokens), want_plain)
  np.testing.assert_array_equal(jitted_forward(plain)(tokens), want_bca)
  rope_model = models.build(model_config(**{**base, 'position': 'rope'}), V, 16,
                            rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^--xpos_block: the model has no xPos position"):
    positions.with_xpos_block(rope_model, 0)


def test_evaluation_position_ids_as_randomized_training_draws_them():
  """eval.py --position_ids: random ids are sorted distinct draws from [0, N) per window (fixed
  seed), spaced ids spread over [0, N), sequential none; runs without randomized positions, and
  windows longer than N, are refused in one line."""
  random_ids = extrapolation.window_position_ids('random', np.arange(3), 16, 128)
  assert random_ids.shape == (3, 16) and random_ids.max() < 128
  assert np.all(np.diff(random_ids, axis=1) > 0) and len({tuple(r) for r in random_ids}) == 3
  # A window's ids are its own, whichever batch (or process) draws it.
  np.testing.assert_array_equal(random_ids[1:],
                                extrapolation.window_position_ids('random', [1, 2], 16, 128))
  np.testing.assert_array_equal(extrapolation.window_position_ids('spaced', [0, 1], 4, 128),
                                [[0, 32, 64, 96]] * 2)
  assert extrapolation.window_position_ids('sequential', [0, 1], 4, 128) is None
  config = validation.resolve(extrapolation_config.get_config())
  config.model.update(position='rope', random_positions_max=256)
  extrapolation.check_position_ids(config, 'random', [1, 2, 4])
  with pytest.raises(ValueError, match=r'^--position_ids=spaced: a window of 512 tokens needs '
                                       r'.*valid: --lengths up to 4$'):
    extrapolation.check_position_ids(config, 'spaced', [8])
  config.model.random_positions_max = 0
  with pytest.raises(ValueError, match=r'^--position_ids=random draws ids .* valid values: '
                                       r'sequential$'):
    extrapolation.check_position_ids(config, 'random', [1])
