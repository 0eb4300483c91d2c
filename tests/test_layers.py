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
from layers import attention
from layers import block
from layers import feed_forward
from layers import norms
from layers import positions
from models import stack

jax.config.update('jax_default_matmul_precision', 'highest')


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


@pytest.mark.parametrize('position,equivariant', [('nope', True), ('sinusoidal', False),
                                                  ('learned', False)])
def test_permutation_equivariance_only_without_positions(position, equivariant):
  cfg = model_config(num_layers=2, d_model=32, num_heads=4, num_kv_heads=4, d_ff=64,
                     position=position)
  enc = stack.Stack(cfg, vocab_size=20, max_length=16, rngs=nnx.Rngs(0))
  if position == 'learned':  # the default init is small; make positions matter visibly
    enc.position.table.embedding.value = jax.random.normal(jax.random.key(9), (16, 32))
  tokens = jnp.array([[3, 7, 1, 9, 4, 12, 5, 2]])
  perm = np.random.default_rng(0).permutation(8)
  out = enc(tokens)
  out_perm = enc(tokens[:, perm])
  close = np.allclose(out[:, perm], out_perm, atol=1e-5)
  assert close == equivariant


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
