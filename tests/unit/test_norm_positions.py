"""The norm positions beyond Pre-LN and Post-LN (layers/block.py): DeepNorm, Sandwich-LN, ReZero.

Each is checked against its defining formula on one block (where the norms sit, DeepNorm's alpha
and beta, ReZero's gates), and each decodes with the KV cache as its full forward pass, scans as it
unrolls, and survives a checkpoint round trip, like the placements before them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from configs import default
from layers import block
from layers import options
from models import accounting
from models import stack
import models
from training import checkpointing
from training import diagnostics
from training import state as state_lib
from training import validation
from tests.helpers import jitted_forward, quick_jit
from tests.unit import test_decoding
from tests.unit import test_scan_layers

NEW = ('deepnorm', 'sandwich', 'rezero')


def model_config(**overrides):
  config = validation.resolve(default.get_config())
  config.model.update({**dict(d_model=16, num_heads=2, num_kv_heads=2, d_ff=32, num_layers=1),
                       **overrides})
  validation.validate(config)
  return config.model


def x_of(shape=(2, 5, 16), seed=0):
  return jax.random.normal(jax.random.key(seed), shape)


def set_gates(model, value):
  """Every ReZero gate of `model` set to `value` (they start at 0: each block the identity)."""
  for _, m in nnx.iter_modules(model):
    if isinstance(m, block.Block):
      for name in ('self', 'cross', 'ffn'):
        gate = getattr(m, f'{name}_gate', None)
        if gate is not None:
          gate.set_value(jnp.full(gate.get_value().shape, value, jnp.float32))
  return model


def test_deepnorm_constants_are_the_papers():
  """DeepNet (Wang et al. 2022), Figure 2: single stack of N layers alpha = (2N)^(1/4),
  beta = (8N)^(-1/4); encoder-decoder with N = M = 6: encoder 0.81 (N^4 M)^(1/16),
  0.87 (N^4 M)^(-1/16), decoder (3M)^(1/4), (12M)^(-1/4)."""
  np.testing.assert_allclose(block.deepnorm_constants('single', 1), (1.1892071, 0.5946036),
                             rtol=1e-6)
  np.testing.assert_allclose(block.deepnorm_constants('single', 6), (1.8612097, 0.3799178),
                             rtol=1e-6)
  np.testing.assert_allclose(block.deepnorm_constants('encoder', 6), (1.4179381, 0.4969892),
                             rtol=1e-6)
  np.testing.assert_allclose(block.deepnorm_constants('decoder', 6), (2.0597671, 0.3432945),
                             rtol=1e-6)
  # The encoder's constants read both depths: a deeper decoder raises its alpha.
  assert block.deepnorm_constants('encoder', 6, 12)[0] > block.deepnorm_constants('encoder', 6)[0]


def test_deepnorm_block_is_post_ln_with_alpha_and_beta():
  """norm(alpha·x + f(x)) per sublayer; value, output and FFN kernels are Post-LN's times beta,
  query and key kernels unchanged (the same draws: beta scales after initialisation)."""
  alpha, beta = block.deepnorm_constants('single', 1)
  post = block.Block(model_config(norm_position='post'), rngs=nnx.Rngs(0))
  deep = block.Block(model_config(norm_position='deepnorm'), rngs=nnx.Rngs(0))
  assert deep.alpha == pytest.approx(alpha) and post.alpha == 1.0
  for name, factor in (('query', 1.0), ('key', 1.0), ('value', beta), ('out', beta)):
    np.testing.assert_allclose(getattr(deep.self_attention, name).kernel[...],
                               factor * getattr(post.self_attention, name).kernel[...], rtol=1e-6)
  for name in ('wi', 'wo'):
    np.testing.assert_allclose(getattr(deep.ffn, name).kernel[...],
                               beta * getattr(post.ffn, name).kernel[...], rtol=1e-6)
  x = x_of()
  h = deep.self_norm(alpha * x + deep.self_attention(x))
  want = deep.ffn_norm(alpha * h + deep.ffn(h))
  np.testing.assert_allclose(deep(x), want, atol=1e-5)


@pytest.mark.parametrize('scales', ['alpha', 'beta'])
def test_deepnorm_scales_keep_one_scaling_alone(scales):
  """The ablation: 'alpha' keeps the up-weighted residual with Post-LN's init, 'beta' the scaled
  init with Post-LN's residual (alpha 1)."""
  alpha, beta = block.deepnorm_constants('single', 1)
  post = block.Block(model_config(norm_position='post'), rngs=nnx.Rngs(0))
  deep = block.Block(model_config(norm_position='deepnorm', deepnorm_scales=scales),
                     rngs=nnx.Rngs(0))
  want_alpha, want_beta = (alpha, 1.0) if scales == 'alpha' else (1.0, beta)
  assert deep.alpha == pytest.approx(want_alpha)
  np.testing.assert_allclose(deep.self_attention.value.kernel[...],
                             want_beta * post.self_attention.value.kernel[...], rtol=1e-6)
  np.testing.assert_allclose(deep.ffn.wo.kernel[...], want_beta * post.ffn.wo.kernel[...],
                             rtol=1e-6)


def test_deepnorm_scales_is_checked_before_building():
  config = validation.resolve(default.get_config())
  config.model.deepnorm_scales = 'gamma'
  with pytest.raises(options.ConfigError,
                     match="deepnorm_scales='gamma'.*alpha, alpha_beta, beta"):
    validation.validate(config)
  config.model.deepnorm_scales = 'alpha'  # under the default 'pre': nothing to ablate
  with pytest.raises(options.ConfigError, match="model.norm_position='pre' does not use"):
    validation.validate(config)


def test_deepnorm_encoder_decoder_uses_the_encoder_and_decoder_constants():
  cfg = model_config(arch='encoder_decoder', norm_position='deepnorm', num_layers=6)
  post_cfg = model_config(arch='encoder_decoder', norm_position='post', num_layers=6)
  deep = models.build(cfg, 23, 16, rngs=nnx.Rngs(0))
  post = models.build(post_cfg, 23, 16, rngs=nnx.Rngs(0))
  for name, role in (('encoder', 'encoder'), ('decoder', 'decoder')):
    alpha, beta = block.deepnorm_constants(role, 6)
    deep_stack, post_stack = getattr(deep, name), getattr(post, name)
    assert deep_stack.final_norm is None
    for i in (0, 5):
      assert deep_stack.blocks[i].alpha == pytest.approx(alpha)
      np.testing.assert_allclose(deep_stack.blocks[i].ffn.wo.kernel[...],
                                 beta * post_stack.blocks[i].ffn.wo.kernel[...], rtol=1e-6)
  # The decoder's cross-attention value/output are scaled too, its query is not.
  alpha, beta = block.deepnorm_constants('decoder', 6)
  d, p = deep.decoder.blocks[0].cross_attention, post.decoder.blocks[0].cross_attention
  np.testing.assert_allclose(d.value.kernel[...], beta * p.value.kernel[...], rtol=1e-6)
  np.testing.assert_allclose(d.query.kernel[...], p.query.kernel[...], rtol=1e-6)


def test_sandwich_block_norms_each_sublayers_input_and_output():
  blk = block.Block(model_config(norm_position='sandwich'), rngs=nnx.Rngs(0))
  x = x_of()
  h = x + blk.self_out_norm(blk.self_attention(blk.self_norm(x)))
  want = h + blk.ffn_out_norm(blk.ffn(blk.ffn_norm(h)))
  np.testing.assert_allclose(blk(x), want, atol=1e-5)
  # The output norm is what differs from Pre-LN: with it, each sublayer adds a unit-RMS term.
  out = blk.self_out_norm(blk.self_attention(blk.self_norm(x)))
  np.testing.assert_allclose(jnp.sqrt(jnp.mean(jnp.square(out), -1)), 1.0, rtol=1e-3)


def test_rezero_block_starts_as_the_identity_and_has_no_norm():
  blk = block.Block(model_config(norm_position='rezero'), rngs=nnx.Rngs(0))
  x = x_of()
  np.testing.assert_array_equal(blk(x), x)
  assert blk.self_norm is None and blk.ffn_norm is None
  names = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(blk, nnx.Param))}
  assert {'self_gate', 'ffn_gate'} <= names and not any('norm' in n for n in names)
  # x + g·f(x) per sublayer, with the gates at other values.
  blk.self_gate.set_value(jnp.float32(0.5))
  blk.ffn_gate.set_value(jnp.float32(-2.0))
  h = x + 0.5 * blk.self_attention(x)
  np.testing.assert_allclose(blk(x), h + -2.0 * blk.ffn(h), atol=1e-5)
  # The gates get a gradient at 0 (the sublayers' own weights do not, until a gate moves).
  graphdef, params = nnx.split(block.Block(model_config(norm_position='rezero'), rngs=nnx.Rngs(0)),
                               nnx.Param)
  grads = jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2 * x))(params)
  assert float(jnp.abs(grads['self_gate'][...])) > 0
  np.testing.assert_array_equal(grads['ffn']['wi']['kernel'][...], 0.0)


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_only', 'encoder_decoder'])
def test_final_norm_follows_the_norm_position(arch):
  """pre and sandwich end with a final norm; post, deepnorm (every block ends on a norm) and
  rezero (no norm at all) do not."""
  for position in block.NORM_POSITIONS:
    model = nnx.eval_shape(lambda p=position: models.build(
        model_config(arch=arch, norm_position=p), 23, 16, rngs=nnx.Rngs(0)))
    for name in ('encoder', 'decoder'):
      if hasattr(model, name):
        has = getattr(model, name).final_norm is not None
        assert has == (position in ('pre', 'sandwich')) == block.FINAL_NORM[position], (position,
                                                                                        name)


def test_rezero_gates_are_in_the_diagnostics():
  config = validation.resolve(default.get_config('quick'))
  config.model.update(norm_position='rezero')
  graphdef, _, state = state_lib.create_state(config, 23)
  params = jax.tree.map(lambda x: x, state['params'])
  model = set_gates(nnx.merge(graphdef, params), 0.25)
  params = nnx.state(model, nnx.Param)
  x = {'inputs': jnp.ones((2, 8), jnp.int32), 'targets': jnp.ones((2, 8), jnp.int32),
       'weights': jnp.ones((2, 8))}
  diag = quick_jit(functools.partial(diagnostics.diagnostic_pass, graphdef))(params, x)
  for i in range(config.model.num_layers):
    for name in ('self', 'ffn'):
      assert float(diag[f'gate_{name}/decoder/blocks/{i}']) == pytest.approx(0.25)


@pytest.mark.parametrize('position', NEW)
@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_cache_equals_full_forward(arch, position):
  model = set_gates(test_decoding.build(arch, position='rope', num_heads=4, num_kv_heads=2,
                                        norm_position=position), 0.5)
  if arch == 'decoder_only':
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, test_decoding.V)
    full, step = test_decoding.full_and_cached_logits(model, {'inputs': tokens},
                                                      {'inputs': tokens}, tokens)
  else:
    batch = test_decoding.enc_dec_batch()
    src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
    full, step = test_decoding.full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('position', NEW)
def test_scanned_equals_unrolled(position):
  arch = 'encoder_decoder'
  unrolled = set_gates(test_scan_layers.init(arch, norm_position=position), 0.5)
  unrolled_def, params = nnx.split(unrolled)
  scanned = test_scan_layers.graphdef(arch, norm_position=position, scan_layers=True)
  x = test_scan_layers.batch(arch)
  logits, s_logits = quick_jit(  # one compilation, not one per eager op
      lambda p, s: (nnx.merge(unrolled_def, p)(x), nnx.merge(scanned, s)(x)))(
          params, test_scan_layers.stacked_like(params))
  np.testing.assert_allclose(s_logits, logits, rtol=1e-5, atol=1e-5)
  if position == 'deepnorm':  # the scanned block carries the stack's alpha (the decoder's)
    own = nnx.eval_shape(lambda: models.build(test_scan_layers.model_config(
        arch, norm_position=position, scan_layers=True), test_scan_layers.V, 16,
        rngs=nnx.Rngs(0)))
    assert own.decoder.blocks.alpha == pytest.approx(
        block.deepnorm_constants('decoder', test_scan_layers.L)[0])
    assert own.encoder.blocks.alpha == unrolled.encoder.blocks[0].alpha


@pytest.mark.parametrize('position,scan', [(p, False) for p in NEW] + [('rezero', True)])
def test_checkpoint_round_trip(tmp_path, position, scan):
  """The state of each placement saves and restores (Orbax), and the restored model computes the
  same logits; a scanned ReZero's gates are one [L] array."""
  config = validation.resolve(default.get_config('quick'))
  config.model.update(norm_position=position, scan_layers=scan)
  graphdef, _, state = state_lib.create_state(config, 23)
  state['params'] = nnx.state(set_gates(nnx.merge(graphdef, state['params']), 0.5), nnx.Param)
  mngr = checkpointing.checkpoint_manager(str(tmp_path), config)
  mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                       data=ocp.args.JsonSave({'position': 0})))
  mngr.wait_until_finished()
  _, fresh = state_lib.create_state(config, 23)[1:]
  restored, _ = checkpointing.restore_state(mngr, fresh)
  mngr.close()
  jax.tree.map(np.testing.assert_array_equal, restored['params'], state['params'])
  x = {'inputs': jnp.arange(16).reshape(2, 8) % 23}
  np.testing.assert_allclose(jitted_forward(nnx.merge(graphdef, restored['params']))(x),
                             jitted_forward(nnx.merge(graphdef, state['params']))(x), rtol=1e-6)
  if scan and position == 'rezero':
    gate = restored['params']['decoder']['blocks']['self_gate'][...]
    assert gate.shape == (config.model.num_layers,) and np.all(gate == 0.5)


@pytest.mark.parametrize('position', NEW)
def test_accounting_counts_each_placements_norms_and_gates(position):
  cfg = model_config(arch='encoder_decoder', norm_position=position, num_layers=2)
  counted = accounting.counted_params(accounting.abstract_model(cfg, 23, 16))
  formula = accounting.formula_params(cfg, 23, 16)
  assert counted == formula
  per = {'deepnorm': 2 * 16, 'sandwich': 2 * 2 * 16, 'rezero': 1}[position]  # per sublayer
  final = 2 * 2 * 16 if position == 'sandwich' else 0
  # 2 encoder layers of 2 sublayers, 2 decoder layers of 3 (self, cross, ffn); 2 final norms
  assert formula['norms'] == per * (2 * 2 + 2 * 3) + final


def test_bad_norm_position_lists_the_new_values():
  config = validation.resolve(default.get_config())
  config.model.norm_position = 'middle'
  with pytest.raises(options.ConfigError, match='deepnorm, post, pre, rezero, sandwich'):
    validation.validate(config)


def test_stack_role_of_each_arch():
  assert stack.deepnorm_role(model_config(arch='decoder_only'), False) == 'single'
  assert stack.deepnorm_role(model_config(arch='encoder_only'), False) == 'single'
  assert stack.deepnorm_role(model_config(arch='encoder_decoder'), False) == 'encoder'
  assert stack.deepnorm_role(model_config(arch='encoder_decoder'), True) == 'decoder'
