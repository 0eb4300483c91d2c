"""The model options that express Hugging Face families (Llama 2/3, Mistral, Qwen2/3, GPT-2) as
attnlab configs: model.norm_eps, embed_scale='plain', output_bias, attention_out_bias, ffn
'gelu_tanh', the llama3 / dynamic RoPE scalings and YaRN's knobs, max_positions, vocab_size.

Each family's decoder is compared with a plain reference written from the formulas (float64 NumPy
for the forward; the same code in jnp under jax.grad for the gradient); the frequencies of the
scalings with transformers' modeling_rope_utils.py rules written out element by element; dynamic
NTK's cached decoding with the per-step frequencies transformers' generation uses. The sliding
window's convention against Mistral's is checked on a float64 reference too."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import attention_variants
from layers import options
from layers import positions as positions_lib
from layers import rope
from models import accounting
from tests.helpers import quick_jit
from training import eval_checks
from training import state as state_lib
from training import validation

jax.config.update('jax_default_matmul_precision', 'highest')

V_TOKENIZER, V = 23, 29  # the model's rows padded beyond the tokenizer's (model.vocab_size)
T, LENGTH = 12, 16  # sequence and training length
D, N, K, F = 32, 4, 2, 48
H = D // N

# Each family's options, at sizes the reference covers (two layers, GQA, T > L for the scalings).
FAMILIES = {
    'llama3': dict(norm='rmsnorm', norm_eps=1e-5, ffn='swiglu', position='rope', rope_base=100.0,
                   rope_scaling='llama3', rope_scaling_factor=4.0, rope_original_length=32,
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, tie_output=False,
                   output_bias=False),
    'qwen2': dict(norm='rmsnorm', norm_eps=1e-6, ffn='swiglu', position='rope', attention_bias=True,
                  attention_out_bias=False, rope_scaling='yarn', rope_scaling_factor=4.0,
                  rope_original_length=16, rope_yarn_beta_fast=8.0, rope_yarn_beta_slow=2.0,
                  rope_attention_factor=1.2),
    'qwen3': dict(norm='rmsnorm', norm_eps=1e-5, ffn='swiglu', position='rope', qk_norm='rmsnorm',
                  rope_scaling='dynamic', rope_scaling_factor=3.0, rope_original_length=8),
    'gpt2': dict(norm='layernorm', norm_eps=1e-5, ffn='gelu_tanh', position='learned',
                 max_positions=20, use_bias=True),
}


def family_config(name, **overrides):
  config = validation.resolve(default.get_config())
  config.model.update(arch='decoder_only', num_layers=1, d_model=D, num_heads=N, num_kv_heads=K,
                      d_ff=F, norm_position='pre', embed_scale='plain', vocab_size=V,
                      **{**FAMILIES[name], **overrides})
  config.data.max_length = LENGTH
  validation.validate(config)
  return config


def build(config):
  vocab = state_lib.model_vocab_size(config, V_TOKENIZER)
  return models.build(config.model, vocab, LENGTH, rngs=nnx.Rngs(0))


# --- The scalings' frequencies, as transformers writes them -----------------------------------

def hf_llama3(d, base, factor, low, high, length):
  """`_compute_llama3_parameters`, one frequency at a time."""
  out = []
  for i in range(0, d, 2):
    theta = 1.0 / base ** (i / d)
    wavelen = 2 * math.pi / theta
    if wavelen < length / high:
      out.append(theta)
    elif wavelen > length / low:
      out.append(theta / factor)
    else:
      smooth = (length / wavelen - low) / (high - low)
      out.append((1 - smooth) * theta / factor + smooth * theta)
  return np.array(out)


def hf_yarn(d, base, factor, length, beta_fast, beta_slow):
  """`_compute_yarn_parameters` (truncate=True), one frequency at a time."""
  def dim(rotations):
    return d * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))
  low, high = max(math.floor(dim(beta_fast)), 0), min(math.ceil(dim(beta_slow)), d - 1)
  high = high + 0.001 if low == high else high
  out = []
  for j in range(d // 2):
    theta = 1.0 / base ** (2 * j / d)
    extrapolate = 1 - min(max((j - low) / (high - low), 0.0), 1.0)
    out.append(theta / factor * (1 - extrapolate) + theta * extrapolate)
  return np.array(out)


def hf_dynamic(d, base, factor, length, seq_len):
  """`_compute_dynamic_ntk_parameters` at `seq_len` (at least L)."""
  seq_len = max(seq_len, length)
  base = base * ((factor * seq_len / length) - (factor - 1)) ** (d / (d - 2))
  return np.array([1.0 / base ** (i / d) for i in range(0, d, 2)])


def test_llama3_frequencies_match_transformers_rule():
  d, base, s = 128, 500000.0, 8.0  # Llama 3.1 8B: rope_theta 500000, factor 8, L = 8192
  params = rope.ScalingParams(original_length=8192, low_freq_factor=1.0, high_freq_factor=4.0)
  got = rope.rope_inv_freq(d, base, 'llama3', s, params=params)
  want = hf_llama3(d, base, s, 1.0, 4.0, 8192)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  theta = base ** (-np.arange(0, d, 2) / d)
  # The highest frequencies are kept, the lowest divided by s, and some blended between.
  assert got[0] == theta[0] and np.isclose(got[-1], theta[-1] / s, rtol=1e-12)
  blended = (got < theta) & (got > theta / s)
  assert 0 < blended.sum() < d // 4
  assert rope.attention_factor('llama3', s, params) == 1.0


def test_yarn_knobs_match_transformers_rule():
  d, base, s = 64, 10000.0, 4.0
  params = rope.ScalingParams(original_length=2048, beta_fast=16.0, beta_slow=2.0,
                              attention_factor=1.3)
  got = rope.rope_inv_freq(d, base, 'yarn', s, params=params)
  np.testing.assert_allclose(got, hf_yarn(d, base, s, 2048, 16.0, 2.0), rtol=1e-12)
  assert not np.allclose(got, rope.rope_inv_freq(d, base, 'yarn', s, 2048), rtol=1e-3)
  assert rope.attention_factor('yarn', s, params) == 1.3
  # The defaults are today's constants and the paper's temperature.
  np.testing.assert_allclose(rope.rope_inv_freq(d, base, 'yarn', s, 2048),
                             hf_yarn(d, base, s, 2048, 32.0, 1.0), rtol=1e-12)
  assert rope.attention_factor('yarn', s, rope.ScalingParams()) == pytest.approx(
      0.1 * math.log(s) + 1)


@pytest.mark.parametrize('last', [0, 7, 8, 20, 100])
def test_dynamic_frequencies_follow_the_calls_largest_position(last):
  d, base, s, length = 16, 10000.0, 3.0, 8
  positions = jnp.array([[0, 3, last], [1, 2, 0]])  # the batch's largest position counts
  got = rope.rope_scaling.dynamic_inv_freq(d, base, s, length, positions)
  want = hf_dynamic(d, base, s, length, last + 1)
  np.testing.assert_allclose(got, want, rtol=2e-6)
  plain = base ** (-np.arange(0, d, 2) / d)
  assert np.allclose(got, plain, rtol=2e-6) == (last + 1 <= length)


# --- The decoder against a plain reference -----------------------------------------------------

def norm(x, p, kind, eps, xp):
  """LayerNorm (scale and shift) or RMSNorm (scale) over the last axis."""
  if kind == 'layernorm':
    x = x - xp.mean(x, -1, keepdims=True)
    return x / xp.sqrt(xp.mean(x * x, -1, keepdims=True) + eps) * p['scale'] + p['bias']
  return x / xp.sqrt(xp.mean(x * x, -1, keepdims=True) + eps) * p['scale']


def linear(x, p, spec, xp):
  """x·kernel (+ bias), contracting x's last axis (or last two for `spec` 'BTNH,NHD->BTD')."""
  y = xp.einsum(spec, x, p['kernel'])
  return y + p['bias'] if 'bias' in p else y


def rotate(x, freqs, scale, xp):
  """Rotate-half RoPE of `[B, T, n, H]` with per-position `freqs` `[T, H/2]`, times `scale`."""
  cos, sin = xp.cos(freqs)[None, :, None], xp.sin(freqs)[None, :, None]  # [1, T, 1, H/2]
  x1, x2 = x[..., :H // 2], x[..., H // 2:]
  return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1) * scale


def visible(window):
  """`[T, T]` causal visibility; with Mistral's `sliding_window` W, keys j > i - W only."""
  i, j = np.arange(T)[:, None], np.arange(T)[None]
  return (j <= i) & (True if window is None else j > i - window)


def attend(x, p, cfg, angles, xp, window=None):
  """Causal GQA attention of `[B, T, D]` with biases where the parameters hold them (and
  Mistral's sliding window W)."""
  q = linear(x, p['query'], 'BTD,DNH->BTNH', xp)
  k = linear(x, p['key'], 'BTD,DKH->BTKH', xp)
  v = linear(x, p['value'], 'BTD,DKH->BTKH', xp)
  if 'qk_norm' in p:
    q = norm(q, {'scale': p['qk_norm']['query_scale']}, 'rmsnorm', cfg.norm_eps, xp)
    k = norm(k, {'scale': p['qk_norm']['key_scale']}, 'rmsnorm', cfg.norm_eps, xp)
  if angles is not None:
    scale = cfg.rope_attention_factor if cfg.rope_scaling == 'yarn' else 1.0
    q, k = rotate(q, angles, scale, xp), rotate(k, angles, scale, xp)
  k, v = xp.repeat(k, N // K, 2), xp.repeat(v, N // K, 2)  # [B, T, N, H]
  s = xp.einsum('BTNH,BSNH->BNTS', q, k) / math.sqrt(H)
  s = xp.where(visible(window), s, -1e30)
  e = xp.exp(s - xp.max(s, -1, keepdims=True))
  y = xp.einsum('BNTS,BSNH->BTNH', e / xp.sum(e, -1, keepdims=True), v)
  return linear(y, p['out'], 'BTNH,NHD->BTD', xp)


def feed_forward(x, p, ffn, xp):
  """SwiGLU, or GPT-2's MLP with the tanh GELU."""
  if ffn == 'swiglu':
    g = linear(x, p['gate'], 'BTD,DF->BTF', xp)
    return linear(g / (1 + xp.exp(-g)) * linear(x, p['up'], 'BTD,DF->BTF', xp), p['down'],
                  'BTF,FD->BTD', xp)
  h = linear(x, p['wi'], 'BTD,DF->BTF', xp)
  h = 0.5 * h * (1 + xp.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
  return linear(h, p['wo'], 'BTF,FD->BTD', xp)


def reference(params, tokens, cfg, angles, xp=np, window=None):
  """Logits `[B, T, V]` of a Pre-LN decoder: plain embedding (+ the learned table), blocks,
  final norm, tied h·E^T or an untied layer (+ its bias, if any). `angles` `[T, H/2]`: each
  position's RoPE angles (None without RoPE); `window`: Mistral's sliding_window W."""
  p = params['decoder']
  x = p['embed']['embedding'][tokens]  # [B, T, D], x 1
  if 'position' in p and 'table' in p['position']:
    x = x + p['position']['table']['embedding'][:T][None]
  for i in range(cfg.num_layers):
    b = p['blocks'][i]
    x = x + attend(norm(x, b['self_norm'], cfg.norm, cfg.norm_eps, xp), b['self_attention'],
                   cfg, angles, xp, window)
    x = x + feed_forward(norm(x, b['ffn_norm'], cfg.norm, cfg.norm_eps, xp), b['ffn'], cfg.ffn, xp)
  x = norm(x, p['final_norm'], cfg.norm, cfg.norm_eps, xp)
  if 'output' in p:
    return linear(x, p['output'], 'BTD,DV->BTV', xp)
  return xp.einsum('BTD,VD->BTV', x, p['embed']['embedding'])


def frequencies(cfg, seq_lens):
  """`[T, H/2]` float64: position j's angle j·theta_i, theta at the call length `seq_lens[j]`."""
  base, s, length = cfg.rope_base, cfg.rope_scaling_factor, cfg.rope_original_length
  rows = []
  for j, n in enumerate(seq_lens):
    if cfg.rope_scaling == 'llama3':
      theta = hf_llama3(H, base, s, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, length)
    elif cfg.rope_scaling == 'yarn':
      theta = hf_yarn(H, base, s, length, cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow)
    elif cfg.rope_scaling == 'dynamic':
      theta = hf_dynamic(H, base, s, length, n)
    else:
      theta = base ** (-np.arange(0, H, 2) / H)
    rows.append(j * theta)
  return np.array(rows)


def f64_tree(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)


def tokens_of(seed=1):
  return jax.random.randint(jax.random.key(seed), (2, T), 0, V_TOKENIZER)


@pytest.mark.parametrize('family', list(FAMILIES))
def test_family_matches_the_float64_reference_forward_and_gradient(family):
  config = family_config(family)
  cfg = config.model
  model = build(config)
  tokens = tokens_of()
  angles = frequencies(cfg, [T] * T) if cfg.position == 'rope' else None
  graphdef, params = nnx.split(model, nnx.Param)
  pure = nnx.to_pure_dict(params)
  got = quick_jit(lambda p: nnx.merge(graphdef, p)({'inputs': tokens}))(params)  # [B, T, V]
  assert got.shape == (2, T, V)
  want = reference(f64_tree(pure), np.asarray(tokens), cfg, angles)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  # The epsilon is the configured one: at the plain embedding's scale (std 0.02) another is seen.
  other = cfg.copy_and_resolve_references()
  other.norm_eps = cfg.norm_eps * 10
  assert np.abs(reference(f64_tree(pure), np.asarray(tokens), other, angles) - want).max() > 1e-3
  # The gradient of every parameter against jax.grad of the same reference in jnp.
  ct = jax.random.normal(jax.random.key(2), (2, T, V))
  grads = quick_jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)({'inputs': tokens}) * ct)))(
      params)
  want_grads = quick_jit(jax.grad(lambda p: jnp.sum(
      reference(p, tokens, cfg, None if angles is None else jnp.asarray(angles, jnp.float32), jnp)
      * ct)))(pure)
  flat_got = dict(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)))
  flat_want = dict(jax.tree_util.tree_leaves_with_path(want_grads))
  assert flat_got.keys() == flat_want.keys()
  for path, value in flat_want.items():
    # Both float32: to the rounding of the largest entry (the embedding's gradient reaches ~100,
    # through norms of std-0.02 rows).
    scale = max(1.0, float(np.abs(value).max()))
    np.testing.assert_allclose(flat_got[path], value, atol=2e-6 * scale, rtol=1e-4,
                               err_msg=jax.tree_util.keystr(path))
  # And the parameters are those the accounting counts.
  counted = accounting.counted_params(accounting.abstract_model(cfg, V, LENGTH))
  assert counted == accounting.formula_params(cfg, V, LENGTH)


def decoded_logits(model, tokens):
  """`[B, T, V]`: the logits of `tokens` fed one step at a time through the KV cache."""
  graphdef, state = nnx.split(model)

  @quick_jit
  def run(state, tokens):
    model = nnx.merge(graphdef, state)
    cache = model.init_cache({'inputs': tokens}, tokens.shape[1])

    def step(cache, t):
      logits, cache = model.decode_step(cache, tokens[:, t], t)
      return cache, logits

    return jax.lax.scan(step, cache, jnp.arange(tokens.shape[1]))[1].swapaxes(0, 1)

  return run(state, tokens)


def test_dynamic_ntk_cached_decoding_is_transformers_generation():
  """Beyond L (T = 12 > 8), the full forward rotates every position at the call's length T, and a
  cached step at position t rotates its query and new key at length t + 1, the keys before it as
  they were stored: the reference with position j's angles at length max(j + 1, L)."""
  config = family_config('qwen3')
  cfg, model, tokens = config.model, build(config), tokens_of()
  params = f64_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  step = decoded_logits(model, tokens)
  want = reference(params, np.asarray(tokens), cfg, frequencies(cfg, [j + 1 for j in range(T)]))
  np.testing.assert_allclose(step, want, atol=2e-5, rtol=1e-4)
  # Within L the scaling is off; beyond it the call's length changes the logits.
  plain = reference(params, np.asarray(tokens), cfg, frequencies(cfg, [1] * T))
  np.testing.assert_allclose(want[:, :cfg.rope_original_length],
                             plain[:, :cfg.rope_original_length], atol=1e-12)
  full = reference(params, np.asarray(tokens), cfg, frequencies(cfg, [T] * T))
  assert np.abs(full - want).max() > 1e-3


def test_sliding_window_is_mistrals_window_minus_one():
  """attnlab's decoder window w sees i - w <= j <= i (w + 1 keys); Mistral's sliding_window W sees
  j > i - W (W keys): W = 4 is model.window = 3, in the full forward and in cached decoding past
  the window (T = 12)."""
  window = 4
  config = family_config('llama3', rope_scaling='none', rope_scaling_factor=1.0,
                         attention='sliding_window', window=window - 1)
  cfg, model, tokens = config.model, build(config), tokens_of()
  params = f64_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  angles = frequencies(cfg, [T] * T)
  want = reference(params, np.asarray(tokens), cfg, angles, window=window)
  np.testing.assert_allclose(quick_jit(lambda: model({'inputs': tokens}))(), want, atol=2e-5,
                             rtol=1e-4)
  np.testing.assert_allclose(decoded_logits(model, tokens), want, atol=2e-5, rtol=1e-4)
  wider = reference(params, np.asarray(tokens), cfg, angles, window=window + 1)
  assert np.abs(wider - want).max() > 1e-3  # one key more is another model


# eval.py's flags at their defaults, but --rope_scaling.
EVAL_FLAGS = dict(split=['validation'], max_examples=0, lengths=[], modes=['non_overlapping'],
                  stride=0.5, num_beams=1, length_penalty=0.6, temperature=1.0, top_k=0, top_p=1.0,
                  plot_attention=0)


def test_eval_time_scaling_applies_llama3_and_dynamic_to_a_built_model():
  """eval.py's --rope_scaling on a model trained without one: the frequencies of the scaling at
  the model's `rope_original_length`, as if it had been built with it."""
  config = family_config('qwen3', rope_scaling='none', rope_scaling_factor=1.0)
  model, tokens = build(config), tokens_of()
  params = f64_tree(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  want_cfg = family_config('qwen3').model  # dynamic, s = 3, L = 8
  positions_lib.with_rope_scaling(model, 'dynamic', 3.0)
  got = quick_jit(lambda: model({'inputs': tokens}))()
  want = reference(params, np.asarray(tokens), want_cfg, frequencies(want_cfg, [T] * T))
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  lines = []
  for flag in ('llama3:4', 'dynamic:2', 'longrope:2'):
    try:
      eval_checks.check_eval_flags(**EVAL_FLAGS, rope_scaling=flag)
    except options.ConfigError as e:
      lines.append(str(e))
  assert lines == ['--rope_scaling=longrope:2 is not valid; valid: none, or pi:F, ntk:F, yarn:F, '
                   'llama3:F, dynamic:F with a factor F >= 1']


def variant_config(variant, out_bias):
  """A one-layer decoder (encoder for a variant with no causal form) with every attention bias
  on (use_bias) and the output projection's as `out_bias`."""
  config = validation.resolve(default.get_config('quick'))
  cls = attention_variants.VARIANTS[variant]
  config.model.update(arch='decoder_only' if cls.supports_causal else 'encoder_only',
                      attention=variant, position='rope', num_layers=1, d_model=16,
                      num_heads=2 * cls.head_multiple, num_kv_heads=cls.head_multiple, d_ff=32,
                      window=2, bigbird_block=4, bigbird_random_blocks=1, linformer_k=4,
                      performer_features=8, use_bias=True, attention_out_bias=out_bias)
  config.data.max_length = LENGTH
  return config


@pytest.mark.parametrize('variant', sorted(attention_variants.VARIANTS))
def test_attention_out_bias_is_honoured_or_refused_by_every_variant(variant):
  """q/k/v biases without the output's (Qwen2): a variant that has projection biases drops the
  output's D of them, in the built model and in the accounting; one without (MLA) refuses
  use_bias in one line."""
  counts = {}
  for out_bias in (True, False):
    config = variant_config(variant, out_bias)
    try:
      validation.validate(config)
    except options.ConfigError as e:
      assert '\n' not in str(e) and str(e).startswith('model.use_bias='), str(e)
      return
    model = accounting.abstract_model(config.model, V, LENGTH)
    counts[out_bias] = accounting.counted_params(model)
    assert counts[out_bias] == accounting.formula_params(config.model, V, LENGTH)
    layer = model.decoder if hasattr(model, 'decoder') else model.encoder
    attn = layer.blocks[0].self_attention
    assert (attn.out.bias is not None) == out_bias and attn.query.bias is not None
  assert counts[True]['attention'] - counts[False]['attention'] == 16  # D


def test_model_vocab_size_pads_the_tokenizers_rows():
  config = family_config('qwen2')
  assert state_lib.model_vocab_size(config, V_TOKENIZER) == V
  assert build(config).decoder.embed.embedding.shape == (V, D)
  config.model.vocab_size = 0
  assert state_lib.model_vocab_size(config, V_TOKENIZER) == V_TOKENIZER
  config.model.vocab_size = V_TOKENIZER - 1
  with pytest.raises(options.ConfigError, match=r"^model.vocab_size=22 must be 0 \(the "
                     r"tokenizer's\) or >= the tokenizer's 23 tokens$"):
    state_lib.model_vocab_size(config, V_TOKENIZER)


def test_learned_table_rows_follow_max_positions():
  config = family_config('gpt2')
  model = accounting.abstract_model(config.model, V, LENGTH)
  assert model.decoder.position.table.embedding.shape == (20, D)  # not data.max_length's 16
  parts = accounting.counted_params(model)
  assert parts['positions'] == 20 * D
  assert parts == accounting.formula_params(config.model, V, LENGTH)
  for rows, extra, message in (
      (8, {}, r'^model.max_positions=8 must be 0 or >= 16 \(data.max_length'),
      (20, {'random_positions_max': 32}, '^model.max_positions=20 must be 0 or >= 32 ')):
    bad = family_config('gpt2')
    bad.model.update(max_positions=rows, **extra)
    with pytest.raises(options.ConfigError, match=message):
      validation.validate(bad)


def test_plain_embedding_and_untied_output_without_bias():
  """embed_scale='plain': rows of std 0.02 (GPT-2's initializer_range), entering x 1, tied logits
  h·E^T (the families' references above); output_bias=False: the untied layer has no bias, V
  parameters fewer."""
  model = models.build(family_config('llama3').model, 4000, LENGTH, rngs=nnx.Rngs(0))
  table = np.asarray(model.decoder.embed.embedding[...])
  assert abs(table.std() - 0.02) < 0.001
  assert model.decoder.embed_scale == 1.0 and model.decoder.logit_scale == 1.0
  assert model.decoder.output.bias is None
  cfg = family_config('llama3').model
  with_bias = cfg.copy_and_resolve_references()
  with_bias.output_bias = True
  assert (accounting.formula_params(with_bias, V, LENGTH)['output']
          - accounting.formula_params(cfg, V, LENGTH)['output']) == V
