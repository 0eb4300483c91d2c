"""models.accounting and the tools.accounting CLI: the textbook numbers (ARCHITECTURE.md, "Facts the
tests check"), counts equal to the real model, FLOPs equal to XLA's."""

from tests.helpers import tiny
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import default
from training import validation
from layers import sharding
import models
from models import accounting
from tools import accounting as accounting_cli
from training import state as state_lib

V = 166  # the toy task's vocabulary
MIB = 2 ** 20


CONFIGS = {
    'dense_mha': {},
    'gqa': dict(num_kv_heads=2),
    'mqa_rmsnorm_post': dict(num_kv_heads=1, norm='rmsnorm', norm_position='post'),
    'swiglu': dict(ffn='swiglu'),
    'geglu_biases_learned': dict(ffn='geglu', use_bias=True, position='learned'),
    't5_bias': dict(position='t5_bias'),
    'encoder_decoder': dict(arch='encoder_decoder'),
    'encoder_decoder_unshared': dict(arch='encoder_decoder', share_embeddings=False,
                                     position='learned'),
    'encoder_only_linformer': dict(arch='encoder_only', attention='linformer'),
}

BUILT = ('dense_mha', 'gqa', 'swiglu', 'encoder_decoder')

FLOPS_RTOL = 0.10


def param_count(model):
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_layer_of_d512_is_12_d_squared_with_two_thirds_in_the_ffn():
  attn = accounting.attention_params(512, 8)
  ffn = accounting.ffn_params(512, 2048)
  assert attn == 4 * 512 ** 2 == 1_048_576
  assert ffn == 8 * 512 ** 2 == 2_097_152
  assert attn + ffn == 12 * 512 ** 2
  assert ffn / (attn + ffn) == pytest.approx(0.667, abs=5e-4)


@pytest.mark.parametrize('heads', [1, 2, 4, 8, 16, 64])
def test_head_count_does_not_change_the_attention_count(heads):
  assert accounting.attention_params(512, heads) == 1_048_576


def test_d768_12_heads_without_biases():
  assert accounting.attention_params(768, 12, use_bias=False) == 2_359_296
  # With biases: q, k, v and o each add D.
  assert accounting.attention_params(768, 12, use_bias=True) == 2_359_296 + 4 * 768


def test_gqa_and_mqa_shrink_only_the_key_value_projections():
  d, h = 512, 64
  assert accounting.attention_params(d, 8, 2) == 2 * d * d + 2 * d * 2 * h
  assert accounting.attention_params(d, 8, 1) == 2 * d * d + 2 * d * h
  assert accounting.ffn_params(d, 2048, 'swiglu') == 3 * d * 2048


def test_kv_cache_of_the_textbook_example():
  """2 (K and V) x 32 layers x 32 heads x head_dim 64 x length 2048."""
  mha = accounting.kv_cache_elements(32, 32, 64, 2048)
  assert mha == 268_435_456  # elements (a source chapter prints "268 MB": the count, not bytes)
  assert mha * 2 == 512 * MIB  # fp16
  assert accounting.kv_cache_elements(32, 8, 64, 2048) * 4 == mha  # GQA, 8 KV heads
  assert accounting.kv_cache_elements(32, 1, 64, 2048) * 32 == mha  # MQA


def test_scores_of_one_head_at_8192_in_fp16():
  assert accounting.score_bytes(8192, 2) == 128 * MIB
  assert accounting.score_bytes(8192, 2, with_softmax=True) == 256 * MIB


def test_kv_cache_formula_is_the_real_cache():
  """2 x L x K x H x T elements: what `init_cache` allocates (shapes only)."""
  config = tiny(num_kv_heads=2)
  m = config.model
  model = accounting.abstract_model(m, V, 64)
  cache = model.init_cache({'inputs': jax.ShapeDtypeStruct((1, 64), jnp.int32)}, 64)
  elems = sum(math.prod(x.shape) for x in jax.tree.leaves(cache))
  assert elems == accounting.kv_cache_elements(m.num_layers, 2, m.d_model // m.num_heads, 64)


@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_counted_parameters_equal_the_closed_form_and_the_real_model(name):
  m = tiny(**CONFIGS[name]).model
  counted = accounting.counted_params(accounting.abstract_model(m, V, 64))
  assert counted == accounting.formula_params(m, V, 64)
  if name in BUILT:
    real = models.build(m, V, 64, rngs=nnx.Rngs(0))
    assert sum(counted.values()) == param_count(real)


def test_textbook_layer_in_the_real_model():
  """D 512, 8 heads, F 2048: the built model's per-layer attention is 4·D² = 1,048,576 and its FFN
  8·D² = 2,097,152 parameters."""
  config = validation.resolve(default.get_config('size=base'))
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, 64))
  assert counted['attention'] == 1_048_576 * 6
  assert counted['ffn'] == 2_097_152 * 6


def xla_flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)['flops']


@pytest.mark.parametrize('length', [64, 256])
def test_forward_flops_agree_with_xla(length):
  config = tiny(length)
  model = models.build(config.model, V, length, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  batch = {'inputs': jnp.zeros((2, length), jnp.int32)}
  xla = xla_flops(lambda s, b: nnx.merge(graphdef, s)(b), state, batch)
  fl = accounting.forward_flops(config.model, V, length)
  ours = 2 * (fl['matmul'] + fl['scores'])
  assert xla / ours == pytest.approx(1.0, rel=FLOPS_RTOL)
  assert xla >= ours  # the elementwise remainder is positive


def test_training_flops_are_three_forwards():
  config = tiny(64, num_layers=1)  # one layer: the backward pass is the slow compile
  model = models.build(config.model, V, 64, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = {'inputs': jnp.zeros((2, 64), jnp.int32)}
  loss = lambda p, b: nnx.merge(graphdef, p, rest)(b).mean()
  xla = xla_flops(jax.value_and_grad(loss), params, batch)
  fl = accounting.forward_flops(config.model, V, 64)
  assert xla / (3 * 2 * (fl['matmul'] + fl['scores'])) == pytest.approx(1.0, rel=FLOPS_RTOL)


def test_causal_scores_are_the_lower_triangle():
  m = tiny(64).model
  fl = accounting.forward_flops(m, V, 64)
  assert fl['scores'] == 2 * 2 * 64 * 64 * m.d_model * m.num_layers  # QK^T and PV, per row
  assert fl['scores_causal'] == 4 * (64 * 65 // 2) * m.d_model * m.num_layers
  bert = accounting.forward_flops(tiny(64, arch='encoder_only').model, V, 64)
  assert bert['scores_causal'] == bert['scores']  # bidirectional: every pair is needed


def test_per_device_parameters_under_fsdp4_tensor2():
  """Matrices split 8 ways (embed over fsdp, heads/mlp/vocab over tensor); the norm vectors carry
  only 'embed', so they are split over fsdp and replicated over tensor (/4)."""
  config = tiny()
  config.mesh.update(data=1, fsdp=4, tensor=2, sequence=1)
  model = accounting.abstract_model(config.model, V, 64)
  total = sum(accounting.counted_params(model).values()) * 4
  norms = accounting.counted_params(model)['norms'] * 4
  per_device = accounting.per_device_param_bytes(model, config.mesh)
  assert per_device == (total - norms) // 8 + norms // 4
  assert per_device == pytest.approx(total / 8, rel=0.01)  # norms are 0.6% of this model


def test_per_device_parameters_equal_the_real_placement():
  """The abstract-mesh count is what train.py's placement puts on a device (8 simulated CPUs),
  here for MQA: its one KV head is not divisible by tensor=2, so k and v are replicated over it."""
  assert len(jax.devices()) == 8
  config = tiny(num_kv_heads=1)
  config.mesh.update(data=1, fsdp=4, tensor=2, sequence=1)
  model = models.build(config.model, V, 64, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  mesh = sharding.make_mesh(config.mesh)
  placed = jax.device_put(params, sharding.named(
      sharding.param_specs(params, mesh, sharding.rules_of(config.mesh)), mesh))
  device = jax.devices()[0]
  on_device = sum(s.data.nbytes for x in jax.tree.leaves(placed) for s in x.addressable_shards
                  if s.device == device)
  assert on_device == accounting.per_device_param_bytes(model, config.mesh)


def test_adam_moments_are_two_parameter_copies():
  config = tiny()
  model = accounting.abstract_model(config.model, V, 64)
  params = nnx.state(model, nnx.Param)
  opt = jax.eval_shape(state_lib.make_optimizer(config.train).init, params)
  moments = sum(math.prod(x.shape) for x in jax.tree.leaves(opt) if x.ndim > 0)
  assert moments == 2 * sum(accounting.counted_params(model).values())


def test_activations_split_over_the_batch_axes():
  m = tiny().model
  one = accounting.activation_bytes(m, V, 8, 64, {'data': 1})
  assert accounting.activation_bytes(m, V, 8, 64, {'data': 2, 'fsdp': 2}) == one // 4
  assert accounting.activation_bytes(m, V, 8, 64, {'tensor': 2}) < one


def test_the_cli_counts_the_toy_vocabulary():
  assert accounting_cli.toy_vocab_size() == V


def test_the_cli_shows_moe_total_and_active_parameters_and_the_experts_per_device():
  """tiny (L 2, D 64, F 256) with 4 experts, top-2, one shared expert, MoE from the 2nd block:
  the router, routed and shared experts apart with their closed forms; total against active;
  the routed experts per device cut by the expert axis."""
  config = tiny(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_first_dense=1)
  config.mesh.expert = 2
  text = accounting_cli.report(config, V)
  one = 2 * 64 * 256  # one expert: 2·D·F_e
  assert f'| FFN (dense blocks) | {one:,} | 1 | {one:,} | 2·D·F |' in text  # the first block
  assert '| MoE router | 256 | 1 | 256 | D·E (E = 4) |' in text
  assert f'| MoE routed experts | {4 * one:,} | 1 | {4 * one:,} | E·2·D·F_e (F_e = 256;' in text
  assert f'| MoE shared experts | {one:,} | 1 | {one:,} | S·2·D·F_e (S = 1) |' in text
  total = sum(accounting.formula_params(config.model, V, config.data.max_length).values())
  active = accounting.active_params(config.model, V, config.data.max_length)
  assert total - active == 2 * one  # two of the four routed experts unused per token
  assert f'**{total:,} parameters in total, {active:,} active**' in text
  assert f'of which the routed experts (E = 4, cut in expert=2 by the expert axis) | ' \
         f'{accounting_cli.human_bytes(4 * one * 4 / 2)} |' in text
