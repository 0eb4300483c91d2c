"""Mixture-of-experts FFN (layers/moe.py): dispatch paths agree, drops follow the documented
order, balancing terms by hand, expert choice, shared experts, placement, decoding, training,
validation and accounting."""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import default
from layers import feed_forward
from layers import moe
from layers import options
from models import accounting
from training import loop
from training import steps
from training import validation
import models
from tests.helpers import metric_rows, quick_jit
from tests.unit.test_decoding import full_and_cached_logits

V = 23
D, F = 8, 16


def make(ffn='relu', experts=4, top_k=2, **kwargs):
  return moe.MoE(D, F, experts, ffn, top_k=top_k, rngs=nnx.Rngs(0), **kwargs)


def on(m, fn):
  """`fn(m, *args)` as one compiled program (eager ops are slow on the shared CPU)."""
  graphdef, state = nnx.split(m)
  return quick_jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args)).__get__(state)


def routed(m, capacity_factor):
  """`m.token_choice` of given logits, compiled: (x, logits) -> (y, stats)."""
  return on(m, lambda m, x, logits: m.token_choice(x, logits, capacity_factor))


def expert_out(m, e, x):
  """Expert e alone on `x` `[..., D]`: the reference the dispatch paths must reproduce."""
  h = m.activation(x @ m.wi[...][e])
  if m.gated:
    h = h * (x @ m.up[...][e])
  return h @ m.wo[...][e]


def model_config(arch='decoder_only', **overrides):
  config = validation.resolve(default.get_config())
  sizes = {'num_layers': 2, 'd_model': 16, 'num_heads': 2, 'num_kv_heads': 2, 'd_ff': 32}
  config.model.update(arch=arch, **{**sizes, **overrides})
  validation.validate(config)
  return config.model


@pytest.mark.parametrize('ffn', ['relu', 'swiglu'])
def test_dropless_equals_unlimited_capacity_forward_and_gradient(ffn):
  m = make(ffn)
  x = jax.random.normal(jax.random.key(1), (2, 5, D))

  def loss(m, x, capacity_factor):
    logits = jnp.einsum('BTD,DE->BTE', x, m.router[...])
    return jnp.sum(jnp.sin(m.token_choice(x, logits, capacity_factor)[0]))

  both = on(m, lambda m, x: [(m.token_choice(x, jnp.einsum('BTD,DE->BTE', x, m.router[...]),
                                                 c)[0], nnx.grad(loss, argnums=(0, 1))(m, x, c))
                             for c in (None, 100.0)])
  for a, b in zip(*map(jax.tree.leaves, both(x))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_capacity_drops_first_choices_before_second_in_position_order():
  """E = 2, k = 2, T = 3, C = 0.5: ceil(0.5·2·3/2) = 2 slots per expert. First choices: token 0
  -> e1, tokens 1, 2 -> e0 (e0 full); second choices by position: token 0 -> e0 dropped,
  token 1 -> e1 kept, token 2 -> e1 dropped. Position-major order would keep token 0's instead."""
  m = make(experts=2, top_k=2)
  x = jax.random.normal(jax.random.key(2), (1, 3, D))
  l3 = math.log(3.0)
  logits = jnp.array([[[0.0, l3], [l3, 0.0], [l3, 0.0]]])  # probs .25/.75, .75/.25, .75/.25
  y, stats = routed(m, 0.5)(x, logits)
  f = lambda e, t: expert_out(m, e, x[0, t])
  want = jnp.stack([0.75 * f(1, 0), 0.75 * f(0, 1) + 0.25 * f(1, 1), 0.75 * f(0, 2)])
  np.testing.assert_allclose(y[0], want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(stats['drop_fraction'], 2 / 6, rtol=1e-6)


def test_a_token_with_every_choice_dropped_gets_zero():
  m = make(experts=2, top_k=1)
  x = jax.random.normal(jax.random.key(3), (1, 4, D))
  logits = jnp.tile(jnp.array([5.0, 0.0]), (1, 4, 1))  # everyone wants e0; 1 slot
  y, stats = routed(m, 0.5)(x, logits)
  gate = jax.nn.softmax(jnp.array([5.0, 0.0]))[0]  # top-1: the unnormalised gate (Switch)
  np.testing.assert_allclose(y[0, 0], gate * expert_out(m, 0, x[0, 0]), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(y[0, 1:], 0.0)
  np.testing.assert_allclose(stats['drop_fraction'], 0.75)


@pytest.mark.parametrize('top_k', [1, 2])
def test_router_learns_through_the_combine_weights(top_k):
  """Top-2 through the renormalised weights, top-1 through Switch's unnormalised gate (a
  renormalised single weight is 1 and would pass no task gradient to the router)."""
  m = make(top_k=top_k)
  x = jax.random.normal(jax.random.key(4), (2, 5, D))
  grad = on(m, nnx.grad(lambda m: jnp.sum(jnp.sin(m(x)))))()
  assert float(jnp.abs(grad['router'][...]).max()) > 1e-4


def test_z_loss_and_aux_loss_by_hand():
  """Tokens with logits (ln 3, 0), (ln 3, 0), (0, ln 3): probabilities .75/.25 twice and .25/.75;
  top-1 loads f = (2/3, 1/3), mean probabilities P = (1.75/3, 1.25/3), so aux = 2·(2/3·1.75/3 +
  1/3·1.25/3) = 9.5/9; every logsumexp is ln 4, so z = (ln 4)²."""
  m = make(experts=2, top_k=1)
  l3 = math.log(3.0)
  logits = jnp.array([[[l3, 0.0], [l3, 0.0], [0.0, l3]]])
  _, stats = routed(m, None)(jnp.ones((1, 3, D)), logits)
  np.testing.assert_allclose(stats['aux_loss'], 9.5 / 9, rtol=1e-6)
  np.testing.assert_allclose(stats['z_loss'], math.log(4.0) ** 2, rtol=1e-6)
  np.testing.assert_allclose(stats['load_cv'], np.std([2, 1]) / 1.5, rtol=1e-6)


def test_expert_choice_takes_each_experts_top_tokens():
  """C = 0.5, k = 1, T = 4, E = 2: one token per expert: e0's highest probability is token 1's,
  e1's token 3's; the other tokens get 0."""
  m = make(experts=2, top_k=1, routing='experts', capacity_factor=0.5)
  x = jax.random.normal(jax.random.key(5), (1, 4, D))
  logits = jnp.array([[[0.0, 0.0], [2.0, 0.0], [0.0, 1.0], [0.0, 3.0]]])
  y, stats = on(m, lambda m, x, logits: m.expert_choice(x, logits))(x, logits)
  p = jax.nn.softmax(logits[0], -1)
  np.testing.assert_allclose(y[0, 1], p[1, 0] * expert_out(m, 0, x[0, 1]), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(y[0, 3], p[3, 1] * expert_out(m, 1, x[0, 3]), atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(y[0, [0, 2]], 0.0)
  np.testing.assert_allclose(stats['drop_fraction'], 0.5)


def test_shared_experts_add_an_always_on_ffn():
  m = make('geglu', shared_experts=2)
  assert isinstance(m.shared, feed_forward.GatedFeedForward)
  assert m.shared.up.kernel.shape == (D, 2 * F)  # two experts of width F side by side
  x = jax.random.normal(jax.random.key(6), (2, 5, D))
  with_shared = on(m, lambda m, x: m(x))(x)
  shared, m.shared = m.shared, None
  np.testing.assert_allclose(with_shared - on(m, lambda m, x: m(x))(x),
                             on(shared, lambda f, x: f(x))(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('every,first,want', [(1, 0, [0, 1, 2, 3, 4]), (2, 1, [2, 4]),
                                              (1, 2, [2, 3, 4]), (3, 0, [2])])
def test_moe_every_and_first_dense_place_the_moe_blocks(every, first, want):
  cfg = model_config(num_layers=5, moe_experts=2, moe_top_k=1, moe_every=every,
                     moe_first_dense=first)
  model = accounting.abstract_model(cfg, V, 8)  # shapes only
  got = [i for i, b in enumerate(model.decoder.blocks) if isinstance(b.ffn, moe.MoE)]
  assert got == want
  assert moe.num_moe_layers(cfg) == len(want)


def test_cached_decoding_equals_the_full_forward():
  cfg = model_config(moe_experts=4, moe_top_k=2, moe_capacity_factor=0.5, moe_shared_experts=1)
  model = models.build(cfg, V, 16, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 1, V)
  full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


ARCH_MOE = {
    'decoder_only': dict(moe_experts=4, moe_top_k=2, moe_capacity_factor=1.0, moe_z_loss=1e-3,
                         moe_router_jitter=0.1),
    'encoder_only': dict(moe_experts=4, moe_top_k=1, moe_routing='experts',
                         moe_capacity_factor=1.0),
    'encoder_decoder': dict(moe_experts=2, moe_top_k=1, moe_shared_experts=1),
}


@pytest.mark.parametrize('arch', list(ARCH_MOE))
def test_each_arch_trains_with_moe_blocks(arch, data_dir, tmp_path):
  config = validation.resolve(importlib.import_module(f'configs.{arch}').get_config('quick'))
  config.data.data_dir = str(data_dir)
  config.train.update(steps=2, log_every=1, eval_every=100, checkpoint_every=100, warmup_steps=0)
  config.model.update(num_layers=1, **ARCH_MOE[arch])
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path))
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2]
  for r in rows:
    assert all(math.isfinite(r[k]) for k in ('loss', 'moe_aux_loss', 'moe_z_loss',
                                             'moe_drop_fraction', 'moe_load_cv'))
    assert r['moe_aux_loss'] > 0.5 and r['moe_z_loss'] > 0 and 0 <= r['moe_drop_fraction'] < 1


BAD = [
    (dict(moe_experts=2, moe_top_k=3), r'^model.moe_top_k=3 exceeds model.moe_experts=2'),
    (dict(moe_experts=2, moe_capacity_factor=-1.0),
     r'^model.moe_capacity_factor=-1.0 must be a non-negative'),
    (dict(moe_experts=2, moe_routing='experts', moe_capacity_factor=1.0),
     r"^model.moe_routing='experts' \(expert choice\).*causal model.arch='decoder_only'"),
    (dict(moe_top_k=1), r'^model.moe_top_k=1 is set but model.moe_experts=0'),
    (dict(moe_experts=2, moe_routing='hash'), r"^model.moe_routing='hash' is not valid; valid "
                                              r'values: experts, tokens'),
    (dict(moe_experts=2, moe_first_dense=2), r'^model.moe_first_dense=2 .* leaves no MoE block'),
    (dict(moe_experts=2, scan_layers=True), r'^model.scan_layers=True'),
    (dict(moe_experts=4, moe_top_k=1, moe_routing='experts', moe_capacity_factor=1.0,
          moe_bias_rate=1e-3, arch='encoder_only'), r'^model.moe_bias_rate balances token choice'),
    (dict(moe_bias_rate=1e-3), r'^model.moe_bias_rate=0.001 is set but model.moe_experts=0'),
    (dict(moe_experts=2, moe_buffer_factor=0.5),
     r'^model.moe_buffer_factor=0.5 would drop assignments of a balanced load'),
    (dict(moe_experts=2, moe_buffer_factor=1.25, moe_capacity_factor=1.0),
     r'^model.moe_buffer_factor=1.25 sizes the dropless receive buffer'),
]


@pytest.mark.parametrize('overrides,message', BAD)
def test_bad_moe_fields_are_one_line_config_errors(overrides, message):
  with pytest.raises(options.ConfigError, match=message) as e:
    model_config(**overrides)
  assert '\n' not in str(e.value)


def test_an_expert_axis_that_does_not_divide_the_experts_is_one_line():
  config = validation.resolve(default.get_config())
  config.model.update(moe_experts=6, moe_top_k=1)
  config.mesh.update(expert=4, data=2)
  with pytest.raises(options.ConfigError,
                     match=r'^mesh.expert=4 must divide model.moe_experts=6; valid values: '
                           r'1, 2, 3, 6$'):
    validation.validate(config)


def test_bias_update_follows_the_sign_rule():
  """b_e += gamma · sign(mean load - load_e): the overloaded expert down, idle ones up, an expert
  at the mean unchanged; the steps add up."""
  m = make(bias_rate=0.1)
  np.testing.assert_array_equal(m.router_bias[...], 0.0)
  m.update_bias(jnp.asarray([5.0, 1.0, 3.0, 3.0]))
  np.testing.assert_allclose(m.router_bias[...], [-0.1, 0.1, 0.0, 0.0], atol=1e-7)
  m.update_bias(jnp.asarray([0.0, 8.0, 4.0, 0.0]))
  np.testing.assert_allclose(m.router_bias[...], [0.0, 0.0, -0.1, 0.1], atol=1e-7)


def test_the_bias_chooses_and_the_probabilities_weigh():
  """A bias far above the probabilities sends every token (k = 1) to expert 2, weighted by its
  unbiased probability (Switch's top-1 gate), whatever the router prefers; the aux loss still sees
  the unbiased probabilities."""
  m = make(top_k=1, bias_rate=0.1)
  m.router_bias[...] = jnp.asarray([0.0, 0.0, 5.0, 0.0])
  x = jax.random.normal(jax.random.key(3), (2, 5, D))
  logits = jnp.einsum('BTD,DE->BTE', x, m.router[...])
  y, stats = on(m, lambda m, x: m.token_choice(x, logits))(x)
  gate = jax.nn.softmax(logits, -1)[..., 2:3]  # [B, T, 1]
  np.testing.assert_allclose(y, gate * expert_out(m, 2, x), atol=1e-5)
  np.testing.assert_array_equal(stats['load'], [0, 0, 10, 0])


def biased_training_state(rows, **overrides):
  """(cfg, graphdef, optimiser, state, batch): a 2-layer MoE model with auxiliary-loss-free biases
  (gamma 0.25, k = 1), a zero-rate optimiser, and a batch of `rows` x 9 tokens."""
  cfg = model_config(moe_experts=4, moe_top_k=1, moe_aux_loss=0.0, moe_bias_rate=0.25,
                     **overrides)
  graphdef, params, buffers = nnx.split(models.build(cfg, V, 16, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tx = optax.sgd(0.0)
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'buffers': buffers,
           'opt_state': tx.init(params), 'skipped': jnp.zeros((), jnp.int32)}
  tokens = jax.random.randint(jax.random.key(1), (rows, 9), 1, V)
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, 1), 'weights': jnp.ones((rows, 9))}
  return cfg, graphdef, tx, state, batch


def test_a_training_step_moves_each_layers_bias_by_its_own_load():
  """steps.train_step: every MoE layer's bias after one step is gamma · sign(mean - load) of the
  assignments that layer routed in the step (read from the same forward pass)."""
  cfg, graphdef, tx, state, batch = biased_training_state(2)
  params = state['params']
  rng = jax.random.key(7)

  def step_and_loads(state, batch):
    new, _ = steps.train_step(graphdef, tx, rng, state, batch, moe_loss=(0.0, 0.0))
    dropout_rng, mask_rng = jax.random.split(jax.random.fold_in(rng, state['step']))
    sums = steps.step_sums(nnx.merge(graphdef, state['params'], state['buffers']), batch,
                           nnx.Rngs(dropout=dropout_rng, mask=mask_rng))
    return new['buffers'], sums['moe_load']

  new_buffers, loads = quick_jit(step_and_loads)(state, batch)
  after = nnx.merge(graphdef, params, new_buffers)
  layers = {'/'.join(map(str, p)): m for p, m in nnx.iter_modules(after)
            if isinstance(m, moe.MoE)}
  assert sorted(layers) == sorted(loads) and len(layers) == cfg.num_layers
  for key, layer in layers.items():
    load = np.asarray(loads[key])
    assert load.sum() == 18  # 2 x 9 tokens, k = 1
    np.testing.assert_allclose(layer.router_bias[...], 0.25 * np.sign(load.mean() - load))


def test_defaults_agree_with_the_config():
  cfg = default.get_config().model
  assert {k: cfg[k] for k in moe.DEFAULTS} == moe.DEFAULTS


@pytest.mark.parametrize('arch,overrides', [
    ('decoder_only', dict(ffn='swiglu', moe_experts=4, moe_top_k=2, moe_d_ff=8,
                          moe_shared_experts=1, moe_every=2)),
    ('encoder_decoder', dict(moe_experts=3, moe_top_k=1, ffn_bias=True)),
])
def test_total_and_active_parameters_equal_the_model(arch, overrides):
  cfg = model_config(arch, **overrides)
  model = accounting.abstract_model(cfg, V, 16)
  assert accounting.counted_params(model) == accounting.formula_params(cfg, V, 16)
  total, idle = 0, 0
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    size = math.prod(var.get_value().shape)
    total += size
    if path[-1] in ('wi', 'up', 'wo') and 'shared' not in path:  # a stack of E experts
      idle += size // cfg.moe_experts * (cfg.moe_experts - cfg.moe_top_k)
  assert accounting.active_params(cfg, V, 16) == total - idle < total
  # FLOPs: the router, the k routed and the shared experts per MoE block, nothing idle.
  dense = model_config(arch, **{k: v for k, v in overrides.items() if not k.startswith('moe')})
  layer = accounting.moe_layer_params(cfg)
  moe_blocks = moe.num_moe_layers(cfg) * (2 if arch == 'encoder_decoder' else 1)
  dense_ffn = accounting.ffn_params(cfg.d_model, cfg.d_ff, cfg.ffn)
  diff = (accounting.forward_flops(cfg, V, 8)['matmul'] -
          accounting.forward_flops(dense, V, 8)['matmul'])
  assert diff == 2 * 8 * moe_blocks * (layer['active'] - dense_ffn)


def test_a_skipped_step_keeps_the_biases_and_accumulation_sums_the_loads():
  """skip_nonfinite: a step whose loss is not finite moves no bias; with gradient accumulation the
  step's load is the sum over its micro-batches (the biases equal the one-batch step's)."""
  cfg, graphdef, tx, state, batch = biased_training_state(4, dropout=0.0)
  nan = jax.tree.map(lambda p: p * jnp.nan, state['params'])

  def steps_of(state, nan):
    step = lambda s, **kw: steps.train_step(graphdef, tx, jax.random.key(7), s, batch,
                                            skip_nonfinite=True, **kw)[0]
    return (step({**state, 'params': nan}), step(state), step(state, accum_steps=2))

  skipped, one, accumulated = quick_jit(steps_of)(state, nan)
  assert int(skipped['skipped']) == 1
  for bias in jax.tree.leaves(skipped['buffers']):
    np.testing.assert_array_equal(bias, 0.0)
  moved = jax.tree.leaves(one['buffers'])
  assert len(moved) == cfg.num_layers and all(np.any(b != 0) for b in moved)
  jax.tree.map(np.testing.assert_array_equal, accumulated['buffers'], one['buffers'])
