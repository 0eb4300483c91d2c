"""Gated DeltaNet (model.attention='gated_deltanet'): the chunked training form against a float64
per-token recurrence written here (forward and gradient), the recurrent decoding form against the
chunked one, padded chunks, the convolution's causality, the whole layer against a float64 NumPy
forward of its parameters, packed segments against separate rows, cached decoding of the layer
and of a model against their full forward, and the refusals (one line each)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from layers import attention_variants
from layers import delta_attention
from layers import delta_rule
from layers import options
from layers import positions
from models import decoding
from tests.unit.test_decoding import build, full_and_cached_logits
from training import validation

B, T, K, G, H = 2, 13, 2, 2, 8
V = 23


def _inputs(seed=0):
  """q `[B, T, K, G, H]` (normalised, scaled), k (normalised), v, β, g (a spread of decays)."""
  rng = np.random.default_rng(seed)
  q = delta_rule.l2_normalise(jnp.asarray(rng.standard_normal((B, T, K, G, H)))) / np.sqrt(H)
  k = delta_rule.l2_normalise(jnp.asarray(rng.standard_normal((B, T, K, H))))
  v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
  beta = jax.nn.sigmoid(jnp.asarray(2 * rng.standard_normal((B, T, K)), jnp.float32))
  g = delta_rule.decay_log(jnp.asarray(rng.standard_normal((B, T, K)), jnp.float32),
                           jnp.log(jnp.asarray([1.0, 8.0])), jnp.asarray([0.5, -1.0]))
  return q, k, v, beta, g


# Row 0: two segments and padding (a start inside a chunk of 4, on the edge of a chunk of 5);
# row 1: a start at 3.
SEGMENTS = np.asarray([[1] * 5 + [2] * 6 + [0] * 2, [1] * 3 + [2] * 10], np.int32)


def naive(q, k, v, beta, g, s0, seg=None):
  """The paper's recurrence token by token, state `[J, H]`: S_t = S_{t-1} α_t (I - β_t k_t k_tᵀ)
  + β_t v_t k_tᵀ, o_t = S_t q_t, with α_t = 0 where `seg` `[B, T]` changes (jnp, in whatever
  precision it is given)."""
  eye = jnp.eye(q.shape[-1], dtype=q.dtype)
  s = jnp.swapaxes(s0, -1, -2)  # [B, K, J, H]
  outs = []
  for t in range(q.shape[1]):
    kt, bt, at = k[:, t], beta[:, t][..., None, None], jnp.exp(g[:, t])[..., None, None]
    if seg is not None and t > 0:
      at = at * (seg[:, t] == seg[:, t - 1])[:, None, None, None]  # a new sequence starts
    s = (at * s @ (eye - bt * kt[..., :, None] * kt[..., None, :])
         + bt * v[:, t][..., :, None] * kt[..., None, :])
    outs.append(jnp.einsum('BKJH,BKGH->BKGJ', s, q[:, t]))
  return jnp.stack(outs, 1), jnp.swapaxes(s, -1, -2)


def _loss(fn, args, w_out, w_state):
  out, state = fn(*args)
  return jnp.sum(out * w_out) + jnp.sum(state * w_state)


@pytest.mark.parametrize('segmented', [False, True], ids=['one-sequence', 'segments'])
@pytest.mark.parametrize('chunk', [1, 4, 5, 64])
def test_chunked_equals_float64_recurrence_forward_and_gradient(chunk, segmented):
  """Chunks of 4 and 5 do not divide T = 13 (padded); 64 > T is one chunk of T; a nonzero initial
  state enters; with `SEGMENTS` the state restarts at each start. Gradients of every input, the
  state included."""
  seg = SEGMENTS if segmented else None
  q, k, v, beta, g = _inputs()
  rng = np.random.default_rng(1)
  s0 = jnp.asarray(0.3 * rng.standard_normal((B, K, H, H)), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((B, T, K, G, H)), jnp.float32)
  w_state = jnp.asarray(rng.standard_normal((B, K, H, H)), jnp.float32)
  args = (q, k, v, beta, g, s0)
  fn = lambda q, k, v, beta, g, s0: delta_rule.chunked(q, k, v, beta, g, chunk=chunk, state=s0,
                                                       segment_ids=seg)
  ref_fn = lambda *a: naive(*a, seg=seg)
  out, state = jax.jit(fn)(*args)
  grads = jax.jit(jax.grad(lambda *a: _loss(fn, a, w_out, w_state), argnums=range(6)))(*args)
  with jax.enable_x64(True):
    a64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in args]
    w64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in (w_out, w_state)]
    ref_out, ref_state = ref_fn(*a64)
    ref_grads = jax.grad(lambda *a: _loss(ref_fn, a, *w64), argnums=range(6))(*a64)
    ref_out, ref_state = np.asarray(ref_out), np.asarray(ref_state)
    ref_grads = [np.asarray(x) for x in ref_grads]
  np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(state, ref_state, atol=2e-6, rtol=1e-5)
  for name, got, want in zip('q k v beta g s0'.split(), grads, ref_grads):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)


def test_recurrent_form_equals_chunked_form():
  """The decoding form (`recurrent_step` per token) against the training form, float32."""
  q, k, v, beta, g = _inputs(seed=3)
  chunked, s_chunked = delta_rule.chunked(q, k, v, beta, g, chunk=4)
  stepped, s_stepped = jax.jit(delta_rule.recurrent)(q, k, v, beta, g)
  np.testing.assert_allclose(stepped, chunked, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(s_stepped, s_chunked, atol=1e-5, rtol=1e-5)
  assert np.abs(chunked).max() > 0.05  # not vacuous


def test_implied_weights_give_the_output_and_are_causal():
  q, k, v, beta, g = _inputs(seed=4)
  out, _ = delta_rule.chunked(q, k, v, beta, g, chunk=5)
  w = delta_rule.implied_weights(q, k, beta, g)  # [B, K, G, T, T]
  np.testing.assert_allclose(jnp.einsum('BKGij,BjKH->BiKGH', w, v), out, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(w)[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] == 0)
  out, _ = delta_rule.chunked(q, k, v, beta, g, chunk=5, segment_ids=SEGMENTS)
  w = delta_rule.implied_weights(q, k, beta, g, SEGMENTS)
  np.testing.assert_allclose(jnp.einsum('BKGij,BjKH->BiKGH', w, v), out, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(w)[0, ..., 5:, :5] == 0)  # the second segment sees nothing of the first


def test_decay_is_in_zero_one_and_l2_norm_is_one():
  q, k, _, _, g = _inputs()
  assert np.all(np.asarray(g) < 0) and np.all(np.exp(np.asarray(g)) > 0)
  np.testing.assert_allclose(np.linalg.norm(k, axis=-1), 1.0, atol=1e-6)
  np.testing.assert_allclose(np.linalg.norm(q, axis=-1), 1.0 / np.sqrt(H), atol=1e-6)


def test_short_conv_is_causal_and_steps_equal_the_whole():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((B, T, 3, 4)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 3, 4)), jnp.float32)
  out, state = delta_rule.short_conv(x, w)
  # A change at t0 reaches t0 .. t0 + W - 1 only.
  out2, _ = delta_rule.short_conv(x.at[:, 6].add(1.0), w)
  changed = np.abs(np.asarray(out2 - out)).max(axis=(0, 2, 3)) > 0
  assert changed.tolist() == [6 <= t <= 9 for t in range(T)]
  # By hand at one position: silu(sum_i w_i x_{t-3+i}).
  want = jax.nn.silu(sum(w[i] * x[:, 5 - 3 + i] for i in range(4)))
  np.testing.assert_allclose(out[:, 5], want, atol=1e-6)
  # Token by token through the state.
  s = jnp.zeros((B, 3, 3, 4))
  steps = []
  for t in range(T):
    o, s = delta_rule.short_conv(x[:, t:t + 1], w, s)
    steps.append(o)
  np.testing.assert_allclose(jnp.concatenate(steps, 1), out, atol=1e-6)
  np.testing.assert_allclose(s, state)
  np.testing.assert_allclose(state, x[:, -3:])


# --- The layer ------------------------------------------------------------------------------------

D, N, KV = 16, 4, 2


def _layer(**kwargs):
  return delta_attention.GatedDeltaNetAttention(D, N, KV, conv=4, chunk=5, rngs=nnx.Rngs(0),
                                                **kwargs)


def _x(t=T, seed=7):
  return jax.random.normal(jax.random.key(seed), (B, t, D))


def _np(p):
  return np.asarray(p[...], np.float64)


def numpy_layer(layer, x):
  """The layer's forward in float64 NumPy from its parameters (no position), token by token."""
  x = np.asarray(x, np.float64)
  h, w = layer.head_dim, layer.conv
  silu = lambda a: a / (1 + np.exp(-a))

  def conv(a, kernel):  # [B, T, C, H], [W, C, H]
    a = np.concatenate([np.zeros((a.shape[0], w - 1) + a.shape[2:]), a], 1)
    return silu(sum(kernel[i] * a[:, i:i + x.shape[1]] for i in range(w)))

  lin = lambda mod, a: np.einsum('btd,d...->bt...', a, _np(mod.kernel))
  q, k, v = (conv(lin(m, x), _np(c)) for m, c in ((layer.query, layer.conv_q),
                                                  (layer.key, layer.conv_k),
                                                  (layer.value, layer.conv_v)))
  q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6) / np.sqrt(h)
  k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
  beta = 1 / (1 + np.exp(-lin(layer.beta_proj, x)))  # [B, T, K]
  a = lin(layer.decay_proj, x) + _np(layer.dt_bias)
  alpha = np.exp(-np.exp(_np(layer.a_log)) * np.log1p(np.exp(a)))  # [B, T, K]
  g = layer.num_heads // layer.num_kv_heads
  s = np.zeros((x.shape[0], layer.num_kv_heads, h, h))  # [B, K, J, H]
  o = np.zeros(q.shape)
  for t in range(x.shape[1]):
    kt = k[:, t]
    s = (alpha[:, t][..., None, None] * (s - beta[:, t][..., None, None]
                                         * np.einsum('bkjh,bkh,bki->bkji', s, kt, kt))
         + beta[:, t][..., None, None] * np.einsum('bkj,bkh->bkjh', v[:, t], kt))
    o[:, t] = np.einsum('bkjh,bkgh->bkgj', s, q[:, t].reshape(-1, layer.num_kv_heads, g, h)
                        ).reshape(o[:, t].shape)
  o = o / np.sqrt((o ** 2).mean(-1, keepdims=True) + 1e-5) * _np(layer.out_norm)
  o = o * silu(lin(layer.gate_proj, x))
  return np.einsum('btnh,nhd->btd', o, _np(layer.out.kernel))


def test_layer_equals_a_float64_numpy_forward_of_its_parameters():
  layer = _layer()
  x = _x()
  got = nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
  np.testing.assert_allclose(got, numpy_layer(layer, x), atol=1e-5, rtol=1e-4)
  assert np.abs(np.asarray(got)).max() > 0.05


def test_layer_gradient_is_causal():
  """The output at t does not depend on inputs after t (the chunks, the convolution)."""
  layer = _layer()
  x = _x()
  jac = nnx.jit(lambda m, x: jax.jacrev(lambda x: m(x, is_causal=True)[0, 6].sum())(x))(
      layer, x)  # [B, T, D]
  assert np.all(np.asarray(jac)[:, 7:] == 0) and np.abs(np.asarray(jac)[0, 3:7]).max() > 0


def test_layer_cached_decode_equals_full_forward():
  """rope; GQA (two query heads per state); 13 tokens over chunks of 5."""
  layer = _layer()
  rope = positions.POSITIONS['rope'](D // N)
  x = _x()
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))

  @nnx.jit
  def run(layer, x):
    full = layer(x, is_causal=True, positions=pos, position=rope)
    cache = layer.init_cache(B, T)
    outs = []
    for t in range(T):
      out, cache = layer.decode(x[:, t:t + 1], cache, t, position=rope)
      outs.append(out)
    return full, jnp.concatenate(outs, 1), cache

  full, stepped, cache = run(layer, x)
  np.testing.assert_allclose(stepped, full, atol=1e-5, rtol=1e-5)
  assert cache['state'].shape == (B, KV, D // N, D // N)
  assert cache['conv_q'].shape == (B, 3, N, D // N)


def test_packed_segments_equal_separate_rows():
  """Each segment of a packed row (padding first, then two sequences) gives the outputs it gives
  alone: the state and the convolutions restart at each start."""
  layer = _layer()
  x = _x()
  seg = jnp.asarray([[0] * 2 + [1] * 5 + [2] * (T - 7), [1] * T])

  @nnx.jit
  def run(layer, x, seg):
    alone = [layer(x[:1, lo:hi], is_causal=True)[0] for lo, hi in ((2, 7), (7, T))]
    return layer(x, is_causal=True, segment_ids=seg), alone, layer(x[1:], is_causal=True)[0]

  packed, alone, row = run(layer, x, seg)
  np.testing.assert_allclose(packed[0, 2:7], alone[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[0, 7:], alone[1], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(packed[1], row, atol=1e-5, rtol=1e-5)


def test_param_count_is_the_layers():
  layer = _layer()
  cfg = validation.resolve(default.get_config()).model
  cfg.update(d_model=D, num_heads=N, num_kv_heads=KV, deltanet_conv=4)
  count = sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))
  assert delta_attention.GatedDeltaNetAttention.param_count(cfg) == count


@pytest.mark.parametrize('scan_layers', [False, True], ids=['layers', 'scanned'])
def test_model_cached_decode_equals_full_forward_and_the_cache_is_constant(scan_layers):
  """21 tokens over chunks of 8; the scanned stack runs the chunked form inside its layer scan."""
  model = build('decoder_only', max_length=32, position='rope', num_heads=4, num_kv_heads=2,
                attention='gated_deltanet', deltanet_chunk=8, scan_layers=scan_layers)
  tokens = jax.random.randint(jax.random.key(1), (2, 21), 1, V)
  full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)
  sizes = {n: decoding.cache_size(model.init_cache({'inputs': tokens}, n)) for n in (8, 64)}
  assert sizes[8] == sizes[64], sizes


# --- Refusals -------------------------------------------------------------------------------------

REFUSED = [
    (dict(arch='encoder_only'), "model.attention='gated_deltanet' is causal only"),
    (dict(arch='encoder_decoder'), "model.attention='gated_deltanet' is causal only"),
    (dict(arch='encoder_decoder', decoder_attention='gated_deltanet'),
     "model.attention='gated_deltanet' is causal only"),
    (dict(position='xpos'), "model.position='xpos' scales q and k"),
    (dict(position='alibi'), "model.position='alibi' adds ALiBi slopes to the scores"),
    (dict(attention_impl='pallas'), "model.attention_impl='pallas' is not used"),
    (dict(deltanet_conv=0), 'model.deltanet_conv=0 must be a positive integer'),
    (dict(deltanet_chunk=-8), 'model.deltanet_chunk=-8 must be a positive integer'),
    (dict(attention_dropout=0.1), 'model.attention_dropout=0.1 is not read'),
]


@pytest.mark.parametrize('model,message', REFUSED, ids=[m[1][:40] for m in REFUSED])
def test_refusals_are_one_line(model, message):
  config = default.get_config()
  config.model.update(attention='gated_deltanet', **model)
  with pytest.raises(options.ConfigError) as e:
    validation.validate(validation.resolve(config))
  assert str(e.value).startswith(message) and '\n' not in str(e.value), str(e.value)
  assert 'valid' in str(e.value)


def test_packed_segments_and_a_dense_encoder_are_accepted():
  config = default.get_config()
  config.model.attention = 'gated_deltanet'
  config.data.packing = 'segments'
  validation.validate(validation.resolve(config))
  config = default.get_config()
  config.model.update(arch='encoder_decoder', attention='dense', decoder_attention='gated_deltanet')
  validation.validate(validation.resolve(config))
  assert attention_variants.VARIANTS['gated_deltanet'].cached_decoding == 'own'
