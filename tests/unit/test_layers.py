"""Parameter counts, positions, norms, feed-forwards and blocks against the textbook facts
(ARCHITECTURE.md, "Facts the tests check")."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import default
from training import validation
from training import validation_attention
from layers import attention
from layers import attention_variants
from layers import block
from layers import feed_forward
from layers import norms
from layers import options
from layers import positions
from layers import rnn_attention

jax.config.update('jax_default_matmul_precision', 'highest')


REGISTRIES = {'attention': attention_variants.VARIANTS, 'position': positions.POSITIONS,
              'norm': norms.NORMS, 'ffn': feed_forward.FFNS,
              'rnn_attention': rnn_attention.RNN_ATTENTIONS}


def n_params(module):
  return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def model_config(**overrides):
  cfg = validation.resolve(default.get_config()).model
  cfg.update(overrides)
  return cfg


@pytest.mark.parametrize('num_heads', [1, 8, 16])
def test_attention_parameters_are_4_d_squared_for_any_head_count(num_heads):
  layer = attention.Attention(512, num_heads, rngs=nnx.Rngs(0))
  assert n_params(layer) == 4 * 512 ** 2 == 1_048_576


def test_bert_base_attention_without_biases():
  assert n_params(attention.Attention(768, 12, rngs=nnx.Rngs(0))) == 2_359_296


def test_ffn_is_8_d_squared_and_two_thirds_of_a_layer():
  ffn = feed_forward.make('relu', 512, 2048, rngs=nnx.Rngs(0))
  assert n_params(ffn) == 8 * 512 ** 2 == 2_097_152
  layer = block.Block(model_config(d_model=512, num_heads=8, num_kv_heads=8, d_ff=2048),
                      rngs=nnx.Rngs(0))
  norm_params = 2 * 2 * 512  # two LayerNorms, scale and shift
  assert n_params(layer) == 12 * 512 ** 2 + norm_params
  assert abs(n_params(ffn) / (12 * 512 ** 2) - 2 / 3) < 1e-9


def test_gated_ffn_matches_formula():
  x = jax.random.normal(jax.random.key(0), (2, 3, 8))
  for name, act in [('swiglu', jax.nn.silu), ('geglu', lambda z: jax.nn.gelu(z, False))]:
    f = feed_forward.make(name, 8, 16, rngs=nnx.Rngs(1))
    want = (act(x @ f.gate.kernel.value) * (x @ f.up.kernel.value)) @ f.down.kernel.value
    np.testing.assert_allclose(f(x), want, atol=1e-5)
    assert n_params(f) == 3 * 8 * 16
  relu = feed_forward.make('relu', 8, 16, rngs=nnx.Rngs(1))
  np.testing.assert_allclose(
      relu(x), jax.nn.relu(x @ relu.wi.kernel.value) @ relu.wo.kernel.value, atol=1e-5)


def test_norms():
  x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (4, 64))
  y = norms.NORMS['layernorm'](64, rngs=nnx.Rngs(0))(x)
  np.testing.assert_allclose(jnp.mean(y, -1), 0.0, atol=1e-5)
  np.testing.assert_allclose(jnp.var(y, -1), 1.0, atol=1e-3)
  z = norms.NORMS['rmsnorm'](64, rngs=nnx.Rngs(0))(x)
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(z ** 2, -1)), 1.0, atol=1e-3)
  np.testing.assert_allclose(z, x / jnp.sqrt(jnp.mean(x ** 2, -1, keepdims=True) + 1e-6),
                             atol=1e-5)


def test_sinusoidal_shift_is_a_fixed_linear_map():
  d = 16
  pe = np.asarray(positions.sinusoid_table(jnp.arange(40), d), np.float64)  # [40, D]
  for delta in (1, 3, 7):
    m = positions.shift_matrix(delta, d)
    np.testing.assert_allclose(pe[:-delta] @ m.T, pe[delta:], atol=2e-5)
  # Golden values: PE(1) = [sin 1, cos 1, sin(1e-4^(2/16)), ...].
  np.testing.assert_allclose(pe[1, :2], [np.sin(1.0), np.cos(1.0)], atol=1e-6)
  np.testing.assert_allclose(pe[0], np.tile([0.0, 1.0], d // 2), atol=0)


def test_learned_positions_reject_longer_inputs():
  pos = positions.make(model_config(position='learned', d_model=8, num_heads=2), 16,
                       rngs=nnx.Rngs(0))
  pos.embed(jnp.zeros((1, 16, 8)), jnp.arange(16)[None])
  with pytest.raises(ValueError, match='max_length=16'):
    pos.embed(jnp.zeros((1, 17, 8)), jnp.arange(17)[None])


@pytest.mark.parametrize('norm_position', ['pre', 'post'])
def test_block_placement(norm_position):
  cfg = model_config(d_model=16, num_heads=2, num_kv_heads=2, d_ff=32, norm_position=norm_position)
  blk = block.Block(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 5, 16))
  attn = lambda h: blk.self_attention(h, is_causal=False)
  if norm_position == 'pre':
    h = x + attn(blk.self_norm(x))
    want = h + blk.ffn(blk.ffn_norm(h))
  else:
    h = blk.self_norm(x + attn(x))
    want = blk.ffn_norm(h + blk.ffn(h))
  np.testing.assert_allclose(blk(x), want, atol=1e-5)


@pytest.mark.parametrize('field', sorted(REGISTRIES))
def test_every_registry_entry_declares_its_options_and_accepts_the_defaults(field):
  config = validation.resolve(default.get_config())
  for name, entry in REGISTRIES[field].items():
    assert set(entry.options) <= set(config.model), (name, entry.options)
    config.model[field] = name
    entry.check_options(config.model)
    if field == 'attention':  # the default arch, or the encoder a variant with no causal form needs
      config.model.arch = 'decoder_only' if entry.supports_causal else 'encoder_only'
    entry.check_config(config.model, config.data)  # returns; a bad value raises ConfigError


def test_a_variant_check_names_its_field_and_valid_values():
  cfg = model_config(attention='longformer', position='t5_bias')
  data = ml_collections.ConfigDict({'max_length': 64})
  # Derived from the declarations (takes_score_terms, the position's terms), not the variant's code.
  with pytest.raises(options.ConfigError, match=r"^model\.position='t5_bias' adds a dense "
                     r"\[T, S\] bias to the scores, which model.attention='longformer' does not "
                     r'take; valid values: learned, nope, rope, sinusoidal, xpos$'):
    validation_attention.check_position_terms(cfg, validation_attention.attention_layers(cfg))
  cfg.update(position='rope', window=-2)
  with pytest.raises(options.ConfigError, match=r'^model\.window=-2 must be an integer >= 0$'):
    attention_variants.VARIANTS['longformer'].check_config(cfg, data)
  with pytest.raises(options.ConfigError, match=r"^model\.rope_scaling='x' is not valid; "
                     'valid values: dynamic, llama3, none, ntk, pi, yarn$'):
    positions.POSITIONS['rope'].check_options(model_config(rope_scaling='x'))


def test_block_sows_statistics_only_when_asked_and_they_match_a_numpy_softmax():
  """collect_stats off: nothing sown. On: the output is unchanged, and the statistics equal a
  NumPy softmax over the layer's own scores (GQA, ALiBi, causal, two segments and padding)."""
  cfg = model_config(d_model=16, num_heads=4, num_kv_heads=2, d_ff=32, position='alibi')
  blk = block.Block(cfg, rngs=nnx.Rngs(0))
  alibi = positions.ALiBi(4)
  x = jax.random.normal(jax.random.key(1), (2, 6, 16))  # [B, T, D]
  seg = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 2, 2, 2, 2]])
  run = nnx.capture(lambda b: b(x, segment_ids=seg, is_causal=True, position=alibi),
                    nnx.Intermediate)
  y, sown = run(blk)
  assert not nnx.to_flat_state(sown)
  blk.collect_stats = True
  y_stats, sown = run(blk)
  np.testing.assert_array_equal(y_stats, y)
  stats = sown['stats'].get_value()[-1]
  assert set(stats) == {'act_rms', 'attn_max_logit', 'attn_entropy', 'attn_sink_share'}

  q, k, _ = (np.asarray(a, np.float64) for a in blk.self_attention.project(blk.self_norm(x)))
  k = np.repeat(k, 2, axis=2)  # [B, S, N, H]: query head n reads key head n // 2
  i, j = np.arange(6)[:, None], np.arange(6)[None, :]
  slopes = positions.alibi_slopes(4)[None, :, None, None]  # [1, N, 1, 1]
  logits = np.einsum('BTNH,BSNH->BNTS', q, k) / np.sqrt(4) - slopes * np.abs(i - j)  # [B, N, T, S]
  s = np.asarray(seg)
  vis = (j <= i)[None, None] & (s[:, None, :, None] == s[:, None, None, :])  # [B, 1, T, S]
  vis = np.broadcast_to(vis, logits.shape)
  real = np.broadcast_to((s > 0)[:, None, :], logits.shape[:3])  # [B, N, T]
  np.testing.assert_allclose(stats['attn_max_logit'], logits[vis & real[..., None]].max(),
                             rtol=1e-5)
  p = np.where(vis, np.exp(logits - np.where(vis, logits, -np.inf).max(-1, keepdims=True)), 0)
  p = p / p.sum(-1, keepdims=True)
  entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)  # [B, N, T]
  np.testing.assert_allclose(stats['attn_entropy'], entropy[real].mean(), rtol=1e-5)
  # Key 0 is the first token of row 0's only segment, and hidden from row 1's second segment.
  np.testing.assert_allclose(stats['attn_sink_share'], p[..., 0][real].mean(), rtol=1e-5)
  y64 = np.asarray(y, np.float64)
  np.testing.assert_allclose(stats['act_rms'], np.sqrt(np.mean(y64[s > 0] ** 2)), rtol=1e-5)


def test_a_layer_without_scores_sows_the_activation_rms_only():
  cfg = model_config(d_model=16, num_heads=4, d_ff=32, attention='linear', position='rope')
  blk = block.Block(cfg, rngs=nnx.Rngs(0))
  assert not blk.self_attention.has_scores
  blk.collect_stats = True
  _, sown = nnx.capture(lambda b: b(jnp.ones((1, 4, 16)), is_causal=True), nnx.Intermediate)(blk)
  assert set(sown['stats'].get_value()[-1]) == {'act_rms'}
  with pytest.raises(NotImplementedError, match='has_scores'):
    blk.self_attention.score_stats(jnp.ones((1, 4, 16)))
