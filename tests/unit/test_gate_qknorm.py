"""model.attention_gate (Qiu et al. 2025's sigmoid gate on each head's output) and model.qk_norm
(per-head RMSNorm of q and k before RoPE): each against a float64 reference of its formula, forward
and gradient; off, the layer is the one it was; every variant applies both, also in its cached
step; bad values are refused in one line. And the attn_sink_share diagnostic against a hand-computed
value. (Two training steps through train.py: tests/integration/test_gate_qknorm_train.py.)"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from layers import attention
from layers import attention_heads
from layers import attention_variants
from layers import attention_xla
from layers import options
from layers import positions
import models
from models import accounting
from tests.helpers import quick_jit, tiny
from tests.unit import test_accounting
from tests.unit import test_decoding
from tests.unit import test_plots
from tools.compare import comparison as compare
from tests.unit import test_scan_layers
from training import validation

D, N, K, H = 16, 4, 2, 4  # GQA: query heads n and n + 1 read key head n // 2
B, T = 2, 5


def layer(gate='none', qk_norm='none', seed=0):
  return attention.Attention(D, N, K, gate=gate, qk_norm=qk_norm, rngs=nnx.Rngs(seed))


def inputs(seed=1):
  return jax.random.normal(jax.random.key(seed), (B, T, D))  # [B, T, D]


def f64(a):
  return np.asarray(a, np.float64)


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def rms_norm(t, scale):
  return t / np.sqrt(np.mean(t ** 2, -1, keepdims=True) + attention_heads.EPSILON) * scale


def reference(lyr, x):
  """(output `[B, T, D]`, the heads' output y `[B, T, N, H]`, the gate's pre-activation) of a
  causal layer in float64 NumPy, written from the formulas: q, k (RMS-normalised with qk_norm),
  softmax(q·k / sqrt(H)) v, y ⊙ sigmoid(x W_θ), then the output projection."""
  x = f64(x)
  q = np.einsum('BTD,DNH->BTNH', x, f64(lyr.query.kernel[...]))
  k = np.einsum('BSD,DKH->BSKH', x, f64(lyr.key.kernel[...]))
  v = np.einsum('BSD,DKH->BSKH', x, f64(lyr.value.kernel[...]))
  if lyr.qk_norm is not None:
    q = rms_norm(q, f64(lyr.qk_norm.query_scale[...]))
    k = rms_norm(k, f64(lyr.qk_norm.key_scale[...]))
  k, v = np.repeat(k, N // K, 2), np.repeat(v, N // K, 2)  # [B, S, N, H]
  logits = np.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(H)
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True)
  y = np.einsum('BNTS,BSNH->BTNH', p, v)
  z = None
  if lyr.output_gate is not None:
    w = f64(lyr.output_gate.proj.kernel[...])  # [D, N, H] or [D, N]
    z = np.einsum('BTD,D...->BT...', x, w)
    g = sigmoid(z) if z.ndim == 4 else sigmoid(z)[..., None]
    y_gated = y * g
  else:
    y_gated = y
  return np.einsum('BTNH,NHD->BTD', y_gated, f64(lyr.out.kernel[...])), y, z


def loss_of(graphdef):
  """sum(ct · layer(x)): a scalar whose gradient reaches every parameter and x."""
  ct = jax.random.normal(jax.random.key(9), (B, T, D))

  def loss(params, x):
    return jnp.sum(nnx.merge(graphdef, params)(x, is_causal=True) * ct)
  return loss, f64(ct)


@pytest.mark.parametrize('kind', ['headwise', 'elementwise'])
def test_gate_matches_the_float64_formula_forward_and_gradient(kind):
  lyr = layer(gate=kind)
  shape = (D, N, H) if kind == 'elementwise' else (D, N)
  assert lyr.output_gate.proj.kernel.shape == shape
  x = inputs()
  want, y, z = reference(lyr, x)
  np.testing.assert_allclose(lyr(x, is_causal=True), want, atol=2e-6, rtol=1e-5)
  # d/dW_θ of sum(ct · out) = x^T [(ct Wo^T) ⊙ y ⊙ σ'(z)], summed over H for one gate per head.
  graphdef, params = nnx.split(lyr)
  loss, ct = loss_of(graphdef)
  grads, grads_x = quick_jit(jax.grad(loss, (0, 1)))(params, x)
  dy = np.einsum('BTD,NHD->BTNH', ct, f64(lyr.out.kernel[...])) * y  # [B, T, N, H]
  dz = (dy if kind == 'elementwise' else dy.sum(-1)) * sigmoid(z) * (1 - sigmoid(z))
  want_dw = np.einsum('BTD,BT...->D...', f64(x), dz)
  np.testing.assert_allclose(grads['output_gate']['proj']['kernel'][...], want_dw, atol=2e-6,
                             rtol=1e-5)
  # The gradient of the input against jax.grad of a plain einsum reference of the same formula.
  def plain(x):
    q = jnp.einsum('BTD,DNH->BTNH', x, lyr.query.kernel[...])
    k = jnp.repeat(jnp.einsum('BSD,DKH->BSKH', x, lyr.key.kernel[...]), N // K, 2)
    v = jnp.repeat(jnp.einsum('BSD,DKH->BSKH', x, lyr.value.kernel[...]), N // K, 2)
    s = jnp.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(H)
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf), -1)
    g = jax.nn.sigmoid(jnp.einsum('BTD,D...->BT...', x, lyr.output_gate.proj.kernel[...]))
    g = g if kind == 'elementwise' else g[..., None]
    out = jnp.einsum('BNTS,BSNH->BTNH', p, v) * g
    return jnp.sum(jnp.einsum('BTNH,NHD->BTD', out, lyr.out.kernel[...]) * ct)
  np.testing.assert_allclose(grads_x, quick_jit(jax.grad(plain))(x), atol=1e-5, rtol=1e-5)
  assert np.abs(grads_x).max() > 1e-2


def test_without_gate_and_qk_norm_the_layer_is_the_one_it_was():
  """Off (the default), no parameter is added and the output is bit-identical to the projection
  of the attention, as `__call__` computed it before `output` existed."""
  lyr = layer()
  assert lyr.output_gate is None and lyr.qk_norm is None
  names = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(lyr, nnx.Param))}
  assert names == {f'{m}/kernel' for m in ('query', 'key', 'value', 'out')}
  x = inputs()
  q, k, v, terms = lyr.prepare(x, is_causal=True)
  before = lyr.out(lyr.attend(q, k, v, terms, is_causal=True))
  np.testing.assert_array_equal(lyr(x, is_causal=True), before)
  qp, kp, _ = lyr.project(x)
  np.testing.assert_array_equal(qp, lyr.query(x))
  np.testing.assert_array_equal(kp, lyr.key(x))
  cfg = validation.resolve(default.get_config()).model
  assert attention.Attention.param_count(cfg) == attention.projection_params(
      cfg.d_model, cfg.num_heads, cfg.num_kv_heads)


def test_qk_norm_matches_the_float64_formula_forward_and_gradient():
  lyr = layer(qk_norm='rmsnorm', gate='elementwise')
  # Learned scales away from 1, so that the reference checks where they enter.
  lyr.qk_norm.query_scale.set_value(jnp.linspace(0.5, 2.0, H))
  lyr.qk_norm.key_scale.set_value(jnp.linspace(1.5, 0.25, H))
  x = inputs()
  q, k, _ = lyr.project(x)
  np.testing.assert_allclose(q, rms_norm(f64(lyr.query(x)), f64(lyr.qk_norm.query_scale[...])),
                             atol=1e-6, rtol=1e-5)
  np.testing.assert_allclose(k, rms_norm(f64(lyr.key(x)), f64(lyr.qk_norm.key_scale[...])),
                             atol=1e-6, rtol=1e-5)
  np.testing.assert_allclose(lyr(x, is_causal=True), reference(lyr, x)[0], atol=2e-6, rtol=1e-5)
  graphdef, params = nnx.split(lyr)
  loss, ct = loss_of(graphdef)
  grads, grads_x = quick_jit(jax.grad(loss, (0, 1)))(params, x)

  def plain(scales, x):  # the same formula in plain jnp
    def norm(t, s):
      return t * jax.lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + 1e-6) * s
    q = norm(jnp.einsum('BTD,DNH->BTNH', x, lyr.query.kernel[...]), scales[0])
    k = jnp.repeat(norm(jnp.einsum('BSD,DKH->BSKH', x, lyr.key.kernel[...]), scales[1]), 2, 2)
    v = jnp.repeat(jnp.einsum('BSD,DKH->BSKH', x, lyr.value.kernel[...]), 2, 2)
    s = jnp.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(H)
    p = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf), -1)
    g = jax.nn.sigmoid(jnp.einsum('BTD,DNH->BTNH', x, lyr.output_gate.proj.kernel[...]))
    out = jnp.einsum('BNTS,BSNH->BTNH', p, v) * g
    return jnp.sum(jnp.einsum('BTNH,NHD->BTD', out, lyr.out.kernel[...]) * ct)
  scales = (lyr.qk_norm.query_scale[...], lyr.qk_norm.key_scale[...])
  want_s, want_x = quick_jit(jax.grad(plain, (0, 1)))(scales, x)
  got = grads['qk_norm']
  np.testing.assert_allclose(got['query_scale'][...], want_s[0], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(got['key_scale'][...], want_s[1], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(grads_x, want_x, atol=1e-5, rtol=1e-5)


def test_qk_norm_comes_before_rope_and_scores_stay_relative():
  """With a non-uniform scale, normalising after the rotation would give other q and k; and the
  scores of RoPE'd normalised q, k still depend on the offset only (positions shifted by 7)."""
  lyr = layer(qk_norm='rmsnorm')
  lyr.qk_norm.query_scale.set_value(jnp.linspace(0.5, 2.0, H))
  cfg = validation.resolve(default.get_config()).model
  cfg.update(position='rope', d_model=D, num_heads=N)
  rope = positions.make(cfg, T + 7, rngs=nnx.Rngs(0))
  x = inputs()
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  q, k, _, _ = lyr.prepare(x, positions=pos, position=rope, is_causal=True)
  q_raw, k_raw = lyr.query(x), lyr.key(x)
  want_q, want_k, _ = rope.in_attention(*lyr.qk_norm(q_raw, k_raw), pos, pos, is_causal=True)
  np.testing.assert_allclose(q, want_q, atol=1e-6)
  np.testing.assert_allclose(k, want_k, atol=1e-6)
  after = lyr.qk_norm(*rope.in_attention(q_raw, k_raw, pos, pos, is_causal=True)[:2])[0]
  assert np.abs(f64(after) - f64(q)).max() > 1e-2
  shifted = lyr.weights(x, positions=pos + 7, position=rope, is_causal=True)
  np.testing.assert_allclose(shifted, lyr.weights(x, positions=pos, position=rope,
                                                  is_causal=True), atol=1e-5)


def variant_config(variant, gate='elementwise', qk_norm='rmsnorm'):
  config = validation.resolve(default.get_config())
  config.model.update(attention=variant, attention_gate=gate, qk_norm=qk_norm, d_model=D,
                      num_heads=N, num_kv_heads=K, d_ff=32, window=2, global_tokens=(0,),
                      bigbird_block=4, bigbird_random_blocks=1, linformer_k=4,
                      performer_features=8, linformer_length=0,
                      arch='decoder_only' if attention_variants.VARIANTS[variant].supports_causal
                      else 'encoder_only')
  config.data.max_length = 16
  return validation.resolve(config)


@pytest.mark.parametrize('variant', sorted(attention_variants.VARIANTS))
def test_every_variant_builds_and_counts_the_gate_and_qk_norm(variant):
  """Each registered variant either applies both (built, counted by its `param_count`, and its
  output moves with the gate's weights) or declares it does not and is refused in one line."""
  cls = attention_variants.VARIANTS[variant]
  config = variant_config(variant)
  if not (cls.gates_output and cls.norms_qk):
    with pytest.raises(options.ConfigError, match=r'^model\.(attention_gate|qk_norm)='):
      validation.validate(config)
    return
  validation.validate(config)
  lyr = cls.from_config(config.model, rngs=nnx.Rngs(0))
  assert lyr.output_gate is not None and lyr.qk_norm is not None
  count = sum(v.size for _, v in nnx.to_flat_state(nnx.state(lyr, nnx.Param)))
  assert count == cls.param_count(config.model)
  graphdef, params = nnx.split(lyr)
  forward = quick_jit(lambda p, x: nnx.merge(graphdef, p)(x, is_causal=cls.supports_causal))
  x = inputs()
  y = forward(params, x)
  params['output_gate']['proj']['kernel'].set_value(params['output_gate']['proj']['kernel'][...]
                                                    * 3.0)
  assert np.abs(f64(forward(params, x)) - f64(y)).max() > 1e-3


def test_cross_attention_is_gated_and_counted():
  """An encoder-decoder's dense cross-attention gets both too (gate from the decoder's input), and
  the closed form counts them: formula == the built model, per component."""
  config = validation.resolve(default.get_config())
  config.model.update(arch='encoder_decoder', attention_gate='headwise', qk_norm='rmsnorm',
                      num_layers=1, d_model=D, num_heads=N, num_kv_heads=K, d_ff=32)
  validation.validate(config)
  counted = accounting.counted_params(accounting.abstract_model(config.model, 23, 16))
  assert counted == accounting.formula_params(config.model, 23, 16)
  per_layer = attention.projection_params(D, N, K) + D * N + 2 * H  # gate D·N, scales 2·H
  assert counted['cross_attention'] == per_layer


CACHED = [('dense', 'headwise'), ('dense', 'elementwise'), ('sliding_window', 'elementwise'),
          ('linear', 'headwise')]


@pytest.mark.parametrize('variant,gate', CACHED)
def test_cached_decode_equals_the_full_forward(variant, gate):
  """The cached steps (the dense `cached_step`, the sliding window's pattern, linear attention's
  prefix sums) gate their output and normalise the new query and key as the forward pass does."""
  extra = {**test_decoding.SPARSE, **test_decoding.KERNEL}.get(variant, {})
  model = test_decoding.build('decoder_only', max_length=16, position='rope', num_heads=4,
                              num_kv_heads=2, attention=variant, attention_gate=gate,
                              qk_norm='rmsnorm', **extra)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, test_decoding.V)
  full, step = test_decoding.full_and_cached_logits(model, {'inputs': tokens},
                                                    {'inputs': tokens}, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


def test_encoder_decoder_cache_equals_the_full_forward():
  """Cross-attention's cached keys (`context_cache`) and its step (`decode_context`) are
  normalised and gated as the full forward's."""
  model = test_decoding.build('encoder_decoder', position='rope', num_heads=4, num_kv_heads=2,
                              attention_gate='elementwise', qk_norm='rmsnorm')
  batch = test_decoding.enc_dec_batch()
  src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
  full, step = test_decoding.full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('field,value,valid', [
    ('attention_gate', 'sigmoid', 'elementwise, headwise, none'),
    ('qk_norm', 'layernorm', 'none, rmsnorm'),
])
def test_an_unknown_value_is_refused_in_one_line(field, value, valid):
  config = validation.resolve(default.get_config())
  config.model[field] = value
  with pytest.raises(options.ConfigError) as e:
    validation.validate(config)
  assert str(e.value) == f'model.{field}={value!r} is not valid; valid values: {valid}'


def test_a_variant_that_declares_no_gate_is_refused_in_one_line(monkeypatch):
  class Ungated(attention.Attention):
    gates_output = False
  monkeypatch.setitem(attention_variants.VARIANTS, 'ungated', Ungated)
  config = validation.resolve(default.get_config())
  config.model.update(attention='ungated', attention_gate='headwise')
  with pytest.raises(options.ConfigError) as e:
    validation.validate(config)
  assert str(e.value) == ("model.attention_gate='headwise' is not applied by "
                          "model.attention='ungated'; valid value here: 'none'")


def test_sink_share_is_the_mean_probability_on_the_first_key():
  """Every row puts logit log 3 on key 0 and 0 on the others, causally: p_{i,0} = 3 / (3 + i),
  i.e. 1, 3/4, 3/5, 1/2 for rows 0..3; row 3 is padding, so the share is (1 + 3/4 + 3/5) / 3."""
  logits = jnp.zeros((1, 2, 4, 4)).at[..., 0].set(jnp.log(3.0))  # [B, N, T, S]
  vis = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4), bool)), logits.shape)
  real = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])  # [B, T]
  stats = attention_xla.score_statistics(logits, vis, real)
  np.testing.assert_allclose(stats['attn_sink_share'], (1 + 3 / 4 + 3 / 5) / 3, rtol=1e-6)
  # A window that hides key 0 from row 3 (sliding window): that row puts 0 on it.
  vis = vis.at[..., 3, 0].set(False)
  stats = attention_xla.score_statistics(logits, vis, jnp.ones((1, 4)))
  np.testing.assert_allclose(stats['attn_sink_share'], (1 + 3 / 4 + 3 / 5 + 0) / 4, rtol=1e-6)


def test_scanned_layers_equal_unrolled_with_both_on():
  """model.scan_layers stacks the gate's and the scales' parameters per layer like the others."""
  kw = dict(attention_gate='elementwise', qk_norm='rmsnorm')
  params = nnx.state(test_scan_layers.init('decoder_only', **kw))
  unrolled = test_scan_layers.graphdef('decoder_only', **kw)
  scanned = test_scan_layers.graphdef('decoder_only', scan_layers=True, **kw)
  x = test_scan_layers.batch('decoder_only')
  want, got = quick_jit(lambda p, s: (nnx.merge(unrolled, p)(x), nnx.merge(scanned, s)(x)))(
      params, test_scan_layers.stacked_like(params))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_compare_tabulates_the_sink_share_per_layer_and_its_layer_mean(tmp_path):
  """tools.compare --metrics: `attn_sink_share/decoder/blocks/1` is that layer's, the bare name
  the mean over the layers of each row."""
  for cell, share in (('a', 0.2), ('b', 0.6)):
    workdir = tmp_path / 'sw' / cell
    test_plots.write_run(str(workdir), {'model.attention_gate': cell, 'train.seed': 0},
                         [4.0, 3.9])
    rows = [{'step': s, 'split': 'train', 'loss': 4.0, 'attn_sink_share/decoder/blocks/0': share,
             'attn_sink_share/decoder/blocks/1': share / 2 * s / 10} for s in (10, 20)]
    with open(workdir / 'metrics.jsonl', 'w') as f:
      f.write('\n'.join(json.dumps(r) for r in rows) + '\n')
  table = compare.compare([str(tmp_path / 'sw')], str(tmp_path / 'cmp.png'),
                          metrics=['attn_sink_share', 'attn_sink_share/decoder/blocks/1'])
  # Cell a: layer means (0.2 + 0.1)/2 = 0.15 and (0.2 + 0.2)/2 = 0.2, run mean 0.175;
  # layer 1 alone: 0.1, 0.2, run mean 0.15.
  assert '| attention_gate=a | 0.175 | 0.2 | 0.15 | 0.2 |' in table, table


def test_forward_flops_count_the_gate_as_xla_does():
  """The gate is one more D x N·H matmul per layer: 2·T·D·N·H more matmul FLOPs per layer, and the
  gated model's forward FLOPs agree with XLA's cost analysis as the plain model's do."""
  length, layers = 64, 2
  flops = {}
  for gate in ('none', 'elementwise'):
    config = tiny(length, attention_gate=gate)
    graphdef, state = nnx.split(models.build(config.model, 23, length, rngs=nnx.Rngs(0)))
    batch = {'inputs': jnp.zeros((2, length), jnp.int32)}
    xla = test_accounting.xla_flops(lambda s, b: nnx.merge(graphdef, s)(b), state, batch)
    fl = accounting.forward_flops(config.model, 23, length)
    flops[gate] = fl['matmul']
    assert xla / (2 * (fl['matmul'] + fl['scores'])) == pytest.approx(
        1.0, rel=test_accounting.FLOPS_RTOL)
  m = config.model
  assert flops['elementwise'] - flops['none'] == 2 * length * m.d_model * m.d_model * layers
