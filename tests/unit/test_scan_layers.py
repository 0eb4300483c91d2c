"""Scanned layers (model.scan_layers, models/stack.py): the same parameters give the unrolled
model's logits and gradients under every remat policy; the stacked parameters keep their logical
axes, per-layer diagnostics and attention maps; a scanned model trains; bad configs are refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from training import validation
from layers import options
from layers import sharding
from models import stack
import models
from training import diagnostics
from tests.helpers import quick_jit

V, L = 23, 2
# Positions applied inside attention (T5 bias, RoPE) are closed over by the scanned block body:
# their gradients must leave the scan as well.
ARCH_POSITION = {'decoder_only': 't5_bias', 'encoder_decoder': 'rope'}
REMATS = {'decoder_only': ('none', 'full', 'dots'), 'encoder_decoder': ('none', 'full')}



def model_config(arch, **overrides):
  config = validation.resolve(default.get_config())
  config.model.update(arch=arch, position=ARCH_POSITION[arch], num_layers=L, d_model=16,
                      num_heads=2, num_kv_heads=2, d_ff=32, **overrides)
  validation.validate(config)
  return config.model


def graphdef(arch, **overrides):
  """The model's graphdef, without initialising it (nnx.eval_shape)."""
  return nnx.graphdef(nnx.eval_shape(
      lambda: models.build(model_config(arch, **overrides), V, 16, rngs=nnx.Rngs(0))))


def init(arch, **overrides):
  """The model with its initial parameters (computed in one compiled call, not op by op)."""
  return nnx.merge(graphdef(arch, **overrides), quick_jit(lambda: nnx.state(
      models.build(model_config(arch, **overrides), V, 16, rngs=nnx.Rngs(0))))())


def batch(arch):
  rng = np.random.default_rng(0)
  if arch == 'decoder_only':
    inputs = jnp.asarray(rng.integers(1, V, (2, 8)))
    return {'inputs': inputs, 'targets': inputs, 'weights': jnp.ones((2, 8))}
  seg = jnp.asarray([[1] * 7, [1] * 5 + [0] * 2])  # row 1's source is padded
  return {'src_inputs': jnp.asarray(rng.integers(1, V, (2, 7))) * seg, 'src_segment_ids': seg,
          'tgt_inputs': jnp.asarray(rng.integers(1, V, (2, 6)))}


def stacked_like(unrolled_state):
  """An unrolled model's state in a scanned model's layout: each stack's blocks stacked."""
  state = jax.tree.map(lambda x: x, unrolled_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  for name in ('encoder', 'decoder'):
    if name in state:
      blocks = state[name]['blocks']
      state[name]['blocks'] = stack.stack_layer_states([blocks[i] for i in range(L)])
  return state


def forward_and_grad(graphdef, params, x):
  def loss(params):
    logits = nnx.merge(graphdef, params)(x)  # [B, T, V]
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

  (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
  return logits, grads


@functools.lru_cache(maxsize=None)
def results(arch):
  """Per arch, from one jit: the unrolled model's initial parameters, and the logits, gradients
  and attention maps of the unrolled model and of the scanned one (each remat policy) on the same
  parameters."""
  params = nnx.state(init(arch))
  graphdefs = {'unrolled': graphdef(arch)}
  graphdefs.update({r: graphdef(arch, scan_layers=True, remat=r) for r in REMATS[arch]})
  x = batch(arch)

  def run(params, stacked):
    out = {}
    for name, g in graphdefs.items():
      p = params if name == 'unrolled' else stacked
      out[name] = forward_and_grad(g, p, x) + (nnx.merge(g, p).attention_weights(x),)
    return out

  return params, quick_jit(run)(params, stacked_like(params))


@pytest.mark.parametrize('arch,remat', [(a, r) for a in REMATS for r in REMATS[a]])
def test_scanned_equals_unrolled_forward_and_gradient(arch, remat):
  params, out = results(arch)
  logits, grads, _ = out['unrolled']
  s_logits, s_grads, _ = out[remat]
  # The converted parameters have the tree, shapes and logical axes of the scanned model's own.
  own = nnx.state(nnx.eval_shape(lambda: models.build(
      model_config(arch, scan_layers=True, remat=remat), V, 16, rngs=nnx.Rngs(0))))
  converted = stacked_like(params)
  assert jax.tree.structure(converted) == jax.tree.structure(own)
  assert jax.tree.map(jnp.shape, converted) == jax.tree.map(jnp.shape, own)
  np.testing.assert_allclose(s_logits, logits, rtol=1e-5, atol=1e-5)
  jax.tree_util.tree_map_with_path(
      lambda path, a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5,
                                                    err_msg=jax.tree_util.keystr(path)),
      s_grads, stacked_like(grads))
  # Every layer's gradient came back through the scan (none is left at zero).
  wi = s_grads['decoder']['blocks']['ffn']['wi']['kernel'][...]  # [L, D, F]
  assert np.all(np.linalg.norm(wi.reshape(L, -1), axis=1) > 0)


def test_attention_weights_of_scanned_layers_equal_unrolled():
  _, out = results('encoder_decoder')
  maps, s_maps = out['unrolled'][2], out['none'][2]
  assert len(s_maps) == L and set(s_maps[0]) == {'self', 'cross'}
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), s_maps, maps)


def test_stacked_parameters_carry_a_leading_layers_axis_and_shard_by_the_rest():
  model = init('decoder_only', scan_layers=True)
  wi = model.decoder.blocks.ffn.wi.kernel
  assert wi.shape == (L, 16, 32)
  assert wi.get_metadata()['logical_axes'] == ('layers', 'embed', 'mlp')
  # The layers differ: each was initialised with its own key.
  assert not np.allclose(wi[...][0], wi[...][1])
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  specs = sharding.param_specs(nnx.state(model), mesh, sharding.DEFAULT_RULES)
  assert specs['decoder']['blocks']['ffn']['wi']['kernel'].get_value() == (
      jax.sharding.PartitionSpec(None, 'fsdp', 'tensor'))
  assert specs['decoder']['blocks']['self_attention']['query']['kernel'].get_value() == (
      jax.sharding.PartitionSpec(None, 'fsdp', 'tensor', None))
  # Layer i's view is a plain Block of the slices, with the per-layer axis names.
  layer = model.decoder.block_list()[1]
  np.testing.assert_array_equal(layer.ffn.wi.kernel[...], wi[...][1])
  assert layer.ffn.wi.kernel.get_metadata()['logical_axes'] == ('embed', 'mlp')


def test_param_groups_split_the_stacked_leaves_per_layer_and_diagnostics_match():
  params, out = results('decoder_only')
  grads = out['unrolled'][1]
  scanned = stacked_like(params)
  u_groups, u_leaf, u_sizes = diagnostics.param_groups(params)
  s_groups, s_leaf, s_sizes = diagnostics.param_groups(scanned)
  assert s_groups == u_groups == ['decoder/blocks/0', 'decoder/blocks/1', 'decoder/embed',
                                  'decoder/final_norm', 'decoder/position']
  assert s_sizes == u_sizes
  assert (0, 1) in s_leaf  # a stacked leaf: row i in block i's group
  assert diagnostics.num_groups(s_leaf) == diagnostics.num_groups(u_leaf) == len(u_groups)
  np.testing.assert_allclose(
      diagnostics.group_sq_norms(stacked_like(grads), s_leaf, len(s_groups)),
      diagnostics.group_sq_norms(grads, u_leaf, len(u_groups)), rtol=1e-6)
  # The activation/attention pass names and measures the scanned blocks as the unrolled ones.
  u_diag, s_diag = quick_jit(
      lambda p, s, x: (diagnostics.diagnostic_pass(graphdef('decoder_only'), p, x),
                       diagnostics.diagnostic_pass(graphdef('decoder_only', scan_layers=True),
                                                   s, x))
  )(params, scanned, batch('decoder_only'))
  assert set(s_diag) == set(u_diag) and 'attn_entropy/decoder/blocks/1' in s_diag
  for key in u_diag:
    np.testing.assert_allclose(s_diag[key], u_diag[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize('overrides,match', [
    (dict(scan_layers=True, remat='some'), "model.remat='some' is not valid; valid values: dots, "
                                           'full, none'),
    (dict(remat='full'), "model.remat='full' needs model.scan_layers=True"),
    (dict(scan_layers=True, attention='bigbird', position='rope'),
     "model.scan_layers=True is not valid for model.attention='bigbird'"),
    (dict(scan_layers=True, attention='performer', position='rope'),
     "model.scan_layers=True is not valid for model.attention='performer'"),
    (dict(scan_layers=True, arch='rnn_seq2seq'),
     "model.scan_layers=True is not valid for model.arch='rnn_seq2seq'"),
    (dict(scan_layers=True, num_layers=0), 'model.num_layers=0 must be a positive integer'),
])
def test_scan_config_is_validated(overrides, match):
  config = validation.resolve(default.get_config())
  config.model.update(scan_layers=True, remat='dots')
  validation.validate(config)  # the other remat policies are valid with scan_layers
  config.model.update(**{'scan_layers': False, 'remat': 'none', **overrides})
  with pytest.raises(options.ConfigError, match=match.replace('(', r'\(').replace(
      ')', r'\)')) as e:
    validation.validate(config)
  assert '\n' not in str(e.value)
