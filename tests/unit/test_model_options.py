"""The model options of the Flax lm1b/wmt examples (issue #18): an untied output with a bias,
attention and feed-forward dropout, separate attention/FFN biases, head_dim != d_model / heads,
xavier_uniform kernels, an unscaled embedding; each validated, each changing only what it names
(all of them together, trained, in tests/integration/test_model_options.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from layers import attention
from layers import attention_xla
from layers import block
from layers import feed_forward
from layers import options
from models import accounting
from training import validation
from tests.helpers import jitted_forward, quick_jit
from tests.unit import test_decoding
import models

V = 23


def config_with(**overrides):
  config = validation.resolve(default.get_config())
  config.model.update({**dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=4, d_ff=64),
                       **overrides})
  validation.validate(config)
  return config


def build(**overrides):
  return models.build(config_with(**overrides).model, V, 16, rngs=nnx.Rngs(0))


def param_names(module):
  return {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def qkv(seed=0, b=2, t=12, n=4, k=2, h=8):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, t, n, h)), jax.random.normal(ks[1], (b, t, k, h)),
          jax.random.normal(ks[2], (b, t, k, h)))


# --- attention dropout ---------------------------------------------------------------------------

def test_attention_dropout_zero_changes_nothing():
  q, k, v = qkv()
  plain = attention.dot_product_attention(q, k, v, is_causal=True)
  zero = attention.dot_product_attention(q, k, v, is_causal=True, dropout_rate=0.0,
                                         dropout_rng=jax.random.key(1))
  np.testing.assert_array_equal(zero, plain)


@pytest.mark.parametrize('is_causal', [False, True])
def test_attention_dropout_xla_and_blockwise_drop_the_same_probabilities(is_causal):
  """The mask is a counter-based function of (row, head, query, key) positions, so blockwise tiles
  (here 5 x 3, not dividing T = 12) draw exactly the slices of the dense kernel's mask: the outputs
  and gradients agree, and differ from the undropped ones."""
  q, k, v = qkv()
  rng = jax.random.key(7)
  kw = dict(is_causal=is_causal, dropout_rate=0.3, dropout_rng=rng)
  dense = lambda q, k, v: attention.dot_product_attention(q, k, v, implementation='xla', **kw)
  tiled = lambda q, k, v: attention.KERNELS['blockwise'].fn(  # noqa: E731
      q, k, v, scale=1 / np.sqrt(8), is_causal=is_causal, dropout_rate=0.3,
      dropout_seed=attention_xla.dropout_seed(rng), block_q=5, block_k=3)
  grad = lambda f, *a: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(*a)  # noqa

  out_tiled, out_dense, g_tiled, g_dense, plain = quick_jit(
      lambda q, k, v: (tiled(q, k, v), dense(q, k, v), grad(tiled, q, k, v), grad(dense, q, k, v),
                       attention.dot_product_attention(q, k, v, is_causal=is_causal)))(q, k, v)
  np.testing.assert_allclose(out_tiled, out_dense, atol=1e-5)
  for a, b in zip(g_tiled, g_dense):
    np.testing.assert_allclose(a, b, atol=1e-5)
  assert float(jnp.max(jnp.abs(out_dense - plain))) > 0.1


def test_attention_dropout_zeroes_the_rate_and_rescales_the_rest():
  """Over a [2, 4, 256, 256] mask the dropped share is the rate (within 4 standard errors); a kept
  probability is divided by 1 - rate, so each row's expected sum stays 1."""
  rate = 0.25
  keys = tuple(w[:, :, None, None] for w in attention_xla.head_keys(
      attention_xla.dropout_seed(jax.random.key(3)), 2, 4))
  keep = attention_xla.dropout_keep(keys, rate, jnp.arange(256)[:, None], jnp.arange(256)[None])
  assert keep.shape == (2, 4, 256, 256)
  dropped = 1.0 - float(jnp.mean(keep))
  assert abs(dropped - rate) < 4 * np.sqrt(rate * (1 - rate) / keep.size)
  # Different heads and rows draw different masks.
  assert float(jnp.mean(keep[0, 0] != keep[0, 1])) > 0.3
  assert float(jnp.mean(keep[0, 0] != keep[1, 0])) > 0.3
  # With uniform attention (equal q·k) and v = one-hot key index, out = kept / (S (1 - rate)).
  s = 64
  q = jnp.zeros((1, 1, 1, s))
  k = jnp.zeros((1, s, 1, s))
  v = jnp.eye(s)[None, :, None, :]  # [1, S, 1, S]
  out = attention.dot_product_attention(q, k, v, dropout_rate=rate, dropout_rng=jax.random.key(3))
  kept = np.asarray(out[0, 0, 0]) * s * (1 - rate)
  np.testing.assert_allclose(kept, np.round(kept), atol=1e-5)  # 0 or 1: dropped or kept
  assert 0 < np.sum(kept == 0) < s


def test_attention_dropout_in_the_model_only_while_training():
  """A model with attention_dropout > 0 evaluates (rngs None) exactly as one without; training
  (a dropout stream) changes the logits, and the same stream gives the same logits."""
  batch = {'inputs': jnp.arange(1, 11).reshape(1, 10)}
  with_drop, without = build(attention_dropout=0.5), build()
  np.testing.assert_array_equal(with_drop(batch), without(batch))
  train = lambda: with_drop(batch, rngs=nnx.Rngs(dropout=5))  # noqa: E731
  assert float(jnp.max(jnp.abs(train() - without(batch)))) > 1e-3
  np.testing.assert_array_equal(train(), train())
  # model.dropout 0, attention_dropout 0: the training pass is the evaluation pass.
  np.testing.assert_array_equal(without(batch, rngs=nnx.Rngs(dropout=5)), without(batch))


def test_attention_dropout_blockwise_model_equals_xla_model():
  batch = {'inputs': jnp.arange(1, 11).reshape(1, 10)}
  xla = build(attention_dropout=0.3)
  blockwise = build(attention_dropout=0.3, attention_impl='blockwise')
  np.testing.assert_allclose(blockwise(batch, rngs=nnx.Rngs(dropout=2)),
                             xla(batch, rngs=nnx.Rngs(dropout=2)), atol=1e-5)


# --- feed-forward dropout ------------------------------------------------------------------------

def test_ffn_dropout_acts_on_the_activations_after_the_nonlinearity():
  """With W_out the identity (F = D) the output is dropout(relu(x W_in)): each positive activation
  is either 0 or itself / (1 - rate), and about `rate` of them are 0; zeros of relu stay 0."""
  rate, d = 0.4, 64
  ffn = feed_forward.make('relu', d, d, dropout=rate, rngs=nnx.Rngs(0))
  ffn.wo.kernel.set_value(jnp.eye(d))
  x = jax.random.normal(jax.random.key(0), (4, 32, d))
  act = jax.nn.relu(ffn.wi(x))
  out = ffn(x, nnx.Rngs(dropout=1))
  positive = act > 0
  kept = np.isclose(out, act / (1 - rate), rtol=1e-5)
  zero = out == 0
  assert np.all(kept | zero) and np.all(zero[~positive])
  share = np.sum(zero & positive) / np.sum(positive)
  assert abs(share - rate) < 4 * np.sqrt(rate * (1 - rate) / np.sum(positive))
  np.testing.assert_array_equal(ffn(x), act)  # no rngs: no dropout


def test_gated_ffn_dropout_zero_is_deterministic():
  ffn = feed_forward.make('swiglu', 16, 32, dropout=0.5, rngs=nnx.Rngs(0))
  x = jnp.ones((1, 3, 16))
  assert float(jnp.max(jnp.abs(ffn(x, nnx.Rngs(dropout=0)) - ffn(x)))) > 0
  np.testing.assert_array_equal(ffn(x), ffn.down(jax.nn.silu(ffn.gate(x)) * ffn.up(x)))


# --- biases, head_dim, init, embedding scale, untied output ------------------------------------

@pytest.mark.parametrize('overrides,attn,ffn', [
    ({}, False, False),
    (dict(use_bias=True), True, True),
    (dict(attention_bias=True), True, False),
    (dict(ffn_bias=True), False, True),
])
def test_attention_and_ffn_biases_are_separate(overrides, attn, ffn):
  names = param_names(block.Block(config_with(**overrides).model, rngs=nnx.Rngs(0)))
  assert ('self_attention/query/bias' in names) == attn
  assert ('self_attention/out/bias' in names) == attn
  assert ('ffn/wi/bias' in names) == ffn and ('ffn/wo/bias' in names) == ffn


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_accounting_follows_the_new_options(arch):
  cfg = config_with(arch=arch, head_dim=12, attention_bias=True, tie_output=False).model
  counted = accounting.counted_params(accounting.abstract_model(cfg, V, 16))
  formula = accounting.formula_params(cfg, V, 16)
  assert counted == formula
  assert formula['output'] == 32 * V + V
  # q, k, v: D·N·H + 2·D·K·H; out: N·H·D; biases N·H + 2·K·H + D; N·H = 48 != D.
  assert accounting.attention_params(32, 4, 4, use_bias=True, head_dim=12) == (
      4 * 32 * 48 + 3 * 48 + 32)


def test_head_dim_projects_to_n_times_h_and_back_to_d():
  model = build(head_dim=12, position='rope')
  attn = model.decoder.blocks[0].self_attention
  assert attn.query.kernel.shape == (32, 4, 12) and attn.key.kernel.shape == (32, 4, 12)
  assert attn.out.kernel.shape == (4, 12, 32)
  assert model.decoder.position.head_dim == 12 and model.decoder.position.rotary_dims == 12
  x = jax.random.normal(jax.random.key(0), (2, 10, 32))
  assert attn(x, is_causal=True).shape == (2, 10, 32)


@pytest.mark.parametrize('impl,position', [('blockwise', 'rope'), ('blockwise', 'alibi'),
                                           ('pallas', 'rope')])
def test_head_dim_kernels_agree_with_xla(impl, position):
  """N·H = 48 != D = 32, H = 12 (not a power of two): the tiled kernels (Pallas interpreted on
  CPU; its Triton lowering is untested here) give the dense kernel's logits."""
  batch = {'inputs': jax.random.randint(jax.random.key(0), (2, 11), 1, V)}
  xla = build(head_dim=12, position=position)
  _, params = nnx.split(xla)
  other = build(head_dim=12, position=position, attention_impl=impl)
  nnx.update(other, params)
  np.testing.assert_allclose(jitted_forward(other)(batch), jitted_forward(xla)(batch), atol=2e-5)


def test_head_dim_with_rope_decodes_as_the_full_forward():
  model = test_decoding.build('decoder_only', position='rope', num_heads=4, num_kv_heads=2,
                              head_dim=6)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  full, step = test_decoding.full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens},
                                                    tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


def test_xavier_uniform_kernels():
  """xavier_uniform: |w| <= sqrt(6 / (fan_in + fan_out)), variance 2 / (fan_in + fan_out), on the
  2-D view of each kernel; lecun_normal (the default) has variance 1 / fan_in."""
  model = build(kernel_init='xavier_uniform', tie_output=False, d_model=64, d_ff=256)
  blk = model.decoder.blocks[0]
  for kernel, fan_in, fan_out in ((blk.self_attention.query.kernel, 64, 64),
                                  (blk.self_attention.out.kernel, 64, 64),
                                  (blk.ffn.wi.kernel, 64, 256),
                                  (model.decoder.output.kernel, 64, V)):
    w = np.asarray(kernel[...]).ravel()
    assert np.max(np.abs(w)) <= np.sqrt(6 / (fan_in + fan_out)) + 1e-6
    np.testing.assert_allclose(np.var(w), 2 / (fan_in + fan_out), rtol=0.15)
  lecun = build(d_model=64, d_ff=256).decoder.blocks[0].ffn.wi.kernel[...]
  np.testing.assert_allclose(np.var(lecun), 1 / 64, rtol=0.15)


def test_embed_scale_none_is_unscaled_with_unit_rows_and_tied_logits_over_sqrt_d():
  scaled, unscaled = build(), build(embed_scale='none', position='nope')
  np.testing.assert_allclose(np.std(unscaled.decoder.embed.embedding[...]), 1.0, rtol=0.1)
  np.testing.assert_allclose(np.std(scaled.decoder.embed.embedding[...]), 32 ** -0.5, rtol=0.1)
  tokens = jnp.array([[3, 5, 7]])
  # The stack's input is the bare embedding (scale 1).
  h = unscaled.decoder.embed(tokens) * unscaled.decoder.embed_scale
  np.testing.assert_array_equal(h, unscaled.decoder.embed(tokens))
  feats = unscaled.features({'inputs': tokens})
  np.testing.assert_allclose(unscaled({'inputs': tokens}),
                             feats @ unscaled.decoder.embed.embedding[...].T / np.sqrt(32),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(unscaled.output_embedding(),
                             unscaled.decoder.embed.embedding[...] / np.sqrt(32), rtol=1e-6)


def test_untied_output_has_its_own_kernel_and_bias():
  model = build(tie_output=False)
  assert model.decoder.output.kernel.shape == (32, V) and model.decoder.output.bias.shape == (V,)
  model.decoder.output.bias.set_value(jnp.arange(V, dtype=jnp.float32))
  batch = {'inputs': jnp.array([[3, 5, 7]])}
  feats = model.features(batch)
  np.testing.assert_allclose(model(batch), feats @ model.decoder.output.kernel[...] + jnp.arange(V),
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='tie_output=False'):
    model.output_embedding()
  # The tied model's parameters draw the same values (the output layer is built last).
  tied = build()
  np.testing.assert_array_equal(tied.decoder.blocks[1].ffn.wo.kernel[...],
                                model.decoder.blocks[1].ffn.wo.kernel[...])


# --- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize('overrides,field', [
    (dict(kernel_init='he_normal'), 'model.kernel_init'),
    (dict(embed_scale='sqrt'), 'model.embed_scale'),
    (dict(attention_dropout=1.0), 'model.attention_dropout'),
    (dict(attention_dropout=-0.1), 'model.attention_dropout'),
    (dict(ffn_dropout=1.5), 'model.ffn_dropout'),
    (dict(head_dim=-4), 'model.head_dim'),
    (dict(attention_dropout=0.1, attention_impl='pallas'), 'model.attention_dropout'),
    (dict(head_dim=8, attention='longformer'), 'model.head_dim'),
    (dict(attention_dropout=0.1, attention='sliding_window'), 'model.attention_dropout'),
    (dict(head_dim=1, position='rope'), 'model.rope_fraction'),
])
def test_bad_model_option_is_one_line_naming_the_field(overrides, field):
  config = validation.resolve(default.get_config())
  config.model.update(overrides)
  with pytest.raises(options.ConfigError, match=field.replace('.', r'\.')) as e:
    validation.validate(config)
  assert '\n' not in str(e.value)


def test_untied_output_refuses_the_tiled_loss():
  config = validation.resolve(default.get_config())
  config.model.tie_output = False
  config.train.loss_chunk = 8
  with pytest.raises(options.ConfigError, match='train.loss_chunk.*tie_output'):
    validation.validate(config)


def test_defaults_keep_the_previous_model():
  """The new fields at their defaults: lecun_normal, sqrt(D) embedding, tied output, no biases,
  H = D / N, no attention or FFN dropout."""
  cfg = default.get_config().model
  assert (cfg.kernel_init, cfg.embed_scale, cfg.tie_output, cfg.attention_bias, cfg.ffn_bias,
          cfg.head_dim, cfg.attention_dropout, cfg.ffn_dropout) == (
              'lecun_normal', 'sqrt_d', True, False, False, 0, 0.0, 0.0)
  model = build()
  assert model.decoder.output is None and model.decoder.embed_scale == np.sqrt(32)
  assert 'ffn/wi/bias' not in param_names(model.decoder.blocks[0])
