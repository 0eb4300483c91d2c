"""model.layer_pattern, hybrid stacks: layer i takes entry i mod len; each entry is validated as
model.attention would be; accounting sums the layers as built; every layer decodes with its own
cache (a KV cache or a recurrent state) and the cached steps equal the full forward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import attention
from layers import attention_variants
from layers import options
from models import accounting
from models import decoding
from tools import accounting as accounting_cli
from training import diagnostics
from training import validation
from training import validation_attention
from tests.helpers import jitted_forward
from tests.unit.test_decoding import enc_dec_batch
from tests.unit.test_decoding import full_and_cached_logits

V = 23


def make_config(pattern, arch='decoder_only', num_layers=4, **overrides):
  """A small resolved config with `model.layer_pattern=pattern` (not yet validated)."""
  config = validation.resolve(default.get_config())
  config.model.update({**dict(arch=arch, layer_pattern=pattern, num_layers=num_layers, d_model=32,
                              num_heads=4, num_kv_heads=2, d_ff=64, position='rope', window=3,
                              performer_features=8, linformer_k=4), **overrides})
  config.data.max_length = 32
  return config


def model_cfg(pattern, **kwargs):
  return make_config(pattern, **kwargs).model


def build(pattern, **kwargs):
  config = make_config(pattern, **kwargs)
  validation.validate(config)
  return models.build(config.model, V, 32, rngs=nnx.Rngs(0))


def refusal(config):
  with pytest.raises(options.ConfigError) as e:
    validation.validate(config)
  message = str(e.value)
  assert '\n' not in message, message
  return message


def test_each_layer_takes_the_pattern_entry_i_mod_its_length():
  model = build('linear,linear,dense', num_layers=5)
  expected = ('linear', 'linear', 'dense', 'linear', 'linear')
  assert models.layer_attentions(make_config('linear,linear,dense', num_layers=5).model) == {
      'decoder': expected}
  assert [type(b.self_attention) for b in model.decoder.blocks] == [
      attention_variants.VARIANTS[name] for name in expected]
  # No pattern: model.attention in every layer; an encoder-decoder repeats it in both stacks.
  assert models.layer_attentions(make_config('').model) == {'decoder': ('dense',) * 4}
  both = models.layer_attentions(make_config('sliding_window,dense', arch='encoder_decoder').model)
  assert both == {'encoder': ('sliding_window', 'dense') * 2,
                  'decoder': ('sliding_window', 'dense') * 2}


def test_an_unknown_entry_is_one_line_naming_the_field_the_entry_and_the_valid_values():
  message = refusal(make_config('linear,lienar,dense'))
  assert message == ("model.layer_pattern='linear,lienar,dense': entry 'lienar' is not valid; "
                     f'valid entries: {", ".join(sorted(attention_variants.VARIANTS))}')
  assert refusal(make_config('linear,,dense')).startswith(
      "model.layer_pattern='linear,,dense': entry '' is not valid; valid entries: ")


def test_each_entry_is_validated_as_model_attention_would_be():
  # Linformer has no causal form: refused in a decoder, accepted in an encoder.
  assert refusal(make_config('linear,linformer')) == (
      "model.layer_pattern='linear,linformer', entry 'linformer': model.attention='linformer' is "
      "not causal and model.arch='decoder_only' needs causal self-attention; valid archs: "
      'encoder_only')
  validation.validate(make_config('linear,linformer', arch='encoder_only'))
  # The entry's own check_config: a projection option the linear entry would not read.
  assert refusal(make_config('linear,dense', head_dim=4)) == (
      "model.layer_pattern='linear,dense', entry 'linear': model.head_dim=4 is read by "
      "model.attention='dense' only, not 'linear'; valid value here: 0")
  # The declarations against the packing and the position, per entry.
  config = make_config('dense,performer')
  config.data.packing = 'segments'
  assert refusal(config).startswith("model.layer_pattern='dense,performer', entry 'performer': "
                                    "data.packing='segments' is not valid for model.attention=")
  assert refusal(make_config('dense,linear', position='alibi')).startswith(
      "model.position='alibi' adds ALiBi slopes to the scores, which model.layer_pattern entry "
      "'linear' does not take; valid values: ")


def test_the_kernel_is_checked_against_the_layers_that_run_it():
  # The dense layers run the blockwise kernel; a pattern with no such layer leaves it unused.
  validation.validate(make_config('linear,dense', attention_impl='blockwise'))
  assert refusal(make_config('linear,performer', attention_impl='blockwise')) == (
      "model.attention_impl='blockwise' is not used: model.layer_pattern entry 'linear', "
      "model.layer_pattern entry 'performer' computes its attention its own way; valid value: "
      "'xla' (the default)")


def test_scan_layers_takes_a_pattern_of_one_variant_only():
  assert refusal(make_config('linear,dense', scan_layers=True)) == (
      "model.scan_layers=True is not valid for model.layer_pattern='linear,dense' (layers of "
      'different variants cannot share one scanned trace); use scan_layers=False, or a pattern '
      'of one variant')
  assert refusal(make_config('performer', scan_layers=True)).startswith(
      "model.scan_layers=True is not valid for model.layer_pattern entry 'performer' (each "
      'layer is built on its own')
  model = build('linear,linear', scan_layers=True)
  assert type(model.decoder.blocks.self_attention) is attention_variants.VARIANTS['linear']


def test_the_other_fields_a_pattern_overrides_are_refused():
  assert refusal(make_config('linear,dense', arch='encoder_decoder',
                             decoder_attention='dense')).startswith(
      "model.layer_pattern='linear,dense' sets every stack's layers, so "
      "model.decoder_attention='dense' would be ignored; valid value with a pattern: ''")
  assert refusal(make_config('linear', arch='rnn_seq2seq')).startswith(
      "model.layer_pattern='linear' is not valid for model.arch='rnn_seq2seq'")


def test_decoding_needs_a_cached_step_in_every_layer(monkeypatch):
  class NoCache(attention.Attention):
    cached_decoding = None

  monkeypatch.setitem(attention_variants.VARIANTS, 'nocache', NoCache)
  model_cfg = make_config('dense,nocache').model
  validation.validate(make_config('dense,nocache'))  # it trains
  assert not validation_attention.decodes_with_cache(model_cfg)
  with pytest.raises(options.ConfigError, match=r"^--translate=test decodes with a KV cache, "
                     r"which model.layer_pattern entry 'nocache' \(NoCache\) does not have; valid "
                     'values: '):
    validation_attention.check_decoding(model_cfg, '--translate=test')
  assert validation_attention.decodes_with_cache(make_config('linear,dense').model)


@pytest.mark.parametrize('pattern,arch', [
    ('linear,linear,linear,dense', 'decoder_only'),
    ('performer,sliding_window,dense', 'decoder_only'),
    ('linformer,dense', 'encoder_only'),
    ('linear,dense,dense', 'encoder_decoder'),
])
def test_accounting_sums_the_layers_as_built(pattern, arch):
  config = make_config(pattern, arch=arch, num_layers=5)
  validation.validate(config)
  m = config.model
  counted = accounting.counted_params(accounting.abstract_model(m, V, 32))
  formula = accounting.formula_params(m, V, 32)
  assert counted == formula
  # The sum over layers by hand: each layer's variant's declared count.
  stacks = models.layer_attentions(m)
  by_hand = 0
  for names in stacks.values():
    for name in names:
      layer_cfg = m.copy_and_resolve_references()
      layer_cfg.attention = name
      by_hand += attention_variants.VARIANTS[name].param_count(layer_cfg)
  assert formula['attention'] == by_hand


def test_an_encoder_decoders_decoder_attention_is_counted_as_built():
  config = make_config('', arch='encoder_decoder', attention='linformer',
                       decoder_attention='dense', num_layers=2)
  validation.validate(config)
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, 32))
  assert counted == accounting.formula_params(config.model, V, 32)


@pytest.mark.parametrize('pattern', ['linear,dense', 'sliding_window,dense,dense'])
def test_a_mixed_decoder_decodes_each_layer_with_its_own_cache(pattern):
  """13 tokens span several windows; each layer's cache has its variant's form (the linear
  layers' running sums, the others' keys and values) and the steps equal the full forward."""
  model = build(pattern)
  tokens = jax.random.randint(jax.random.key(1), (2, 13), 1, V)
  cache = model.init_cache({'inputs': tokens}, 16)
  for layer, name in zip(cache['self'], models.layer_attentions(model_cfg(pattern))['decoder']):
    assert ('k' in layer) == (name != 'linear'), (name, jax.tree.map(jnp.shape, layer))
  full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  err = float(np.max(np.abs(np.asarray(step) - np.asarray(full))))
  assert err < 1e-5, err
  # The pattern matters: the same parameters as dense layers give other logits.
  dense = nnx.merge(*nnx.split(model))
  for blk in dense.decoder.blocks:
    blk.self_attention.__class__ = attention.Attention
    blk.self_attention.local_window_size = None
  assert np.abs(dense({'inputs': tokens}) - full).max() > 1e-3


def test_a_mixed_encoder_decoder_decodes_with_its_caches():
  model = build('sliding_window,dense', arch='encoder_decoder', num_layers=2)
  batch = enc_dec_batch()
  src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
  full, step = full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('variant', ['linear', 'sliding_window'])
def test_a_pattern_of_one_entry_is_the_plain_model(variant):
  hybrid = build(variant)
  plain = build('', attention=variant)
  a, b = nnx.state(hybrid, nnx.Param), nnx.state(plain, nnx.Param)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  np.testing.assert_array_equal(jitted_forward(hybrid)({'inputs': tokens}),
                                jitted_forward(plain)({'inputs': tokens}))


def test_the_diagnostic_pass_reports_scores_for_the_layers_that_have_them():
  model = build('linear,dense')
  graphdef, params = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  batch = {'inputs': tokens, 'targets': tokens, 'weights': jnp.ones(tokens.shape)}
  out = jax.jit(diagnostics.diagnostic_pass, static_argnums=0)(graphdef, params, batch)
  for i in range(4):
    assert np.isfinite(float(out[f'act_rms/decoder/blocks/{i}']))
    assert (f'attn_entropy/decoder/blocks/{i}' in out) == (i % 2 == 1), sorted(out)
  # A dense layer's entropy is at most log(keys seen) (the last query sees 9 keys).
  assert 0 < float(out['attn_entropy/decoder/blocks/1']) <= np.log(9)


def test_the_accounting_cli_prints_the_pattern_and_sums_its_layers():
  """Three linear layers to one dense, D 32, K 2 of 4 heads (H 8): each layer's projections are
  2·D² + 2·D·K·H = 3,072, the linear layers having no parameters of their own."""
  config = make_config('linear,linear,linear,dense', position='sinusoidal')
  validation.validate(config)
  text = accounting_cli.report(config, V)
  assert 'layer_pattern=linear,linear,linear,dense' in text.splitlines()[0]
  assert '| attention | 3,072 | 4 | 12,288 |' in text
  assert 'the linear layers compute their own pattern' in text


def test_a_mixed_decoder_generates_the_same_with_and_without_its_caches():
  """Cached greedy decoding equals greedy over full forward passes, and one beam (whose step
  reorders every layer's cache, states and keys alike, by beam) equals greedy."""
  model = build('linear,sliding_window,dense', num_layers=3)
  prompts = [[1, 7, 8, 3], [1, 9, 3], [1, 10, 11, 12, 13, 3]]
  kwargs = dict(length=20, max_new=8, eos_id=2, batch_size=3)
  greedy = decoding.greedy_translate(model, prompts, **kwargs)
  assert greedy == decoding.greedy_translate(model, prompts, use_cache=False, **kwargs)
  beam = decoding.generate(model, prompts, max_new=8, eos_id=2, method='beam', num_beams=1,
                           length_penalty=0.6)
  assert beam == decoding.generate(model, prompts, max_new=8, eos_id=2)
  assert any(len(g) > 0 for g in greedy)
