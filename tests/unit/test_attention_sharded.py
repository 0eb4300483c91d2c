"""The Pallas kernel under shard_map on 8 simulated CPU devices (interpreted) against the
same kernel
on one device: forward and gradients to 1e-5, for each way the mesh can cut batch and heads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from layers import attention
from layers import attention_sharded
from layers import options
from layers import sharding
from tests.helpers import quick_jit

T, H = 24, 8
TOL = 1e-5

CASES = {
    # mesh (data, fsdp, tensor, sequence), B, N, K, options
    'fsdp8_causal_alibi_segments_gqa': ((1, 8, 1, 1), 8, 4, 2,
                                        dict(is_causal=True, alibi=True, segments=True)),
    'data2_fsdp2_tensor2_window_segments_alibi_gqa': ((2, 2, 2, 1), 4, 4, 2, dict(
        local_window_size=(5, 2), segments=True, alibi=True)),
    'tensor8_causal_alibi': ((1, 1, 8, 1), 2, 8, 8, dict(is_causal=True, alibi=True)),
    # K = 1 < tensor = 2: the one KV head is repeated to each head shard.
    'tensor2_mqa_causal_segments': ((1, 1, 2, 1), 2, 4, 1, dict(is_causal=True, segments=True)),
    # K = 2 < tensor = 4: KV head i // 2 on shard i.
    'tensor4_gqa_k2_causal_alibi': ((1, 1, 4, 1), 2, 8, 2, dict(is_causal=True, alibi=True)),
    # N = 6 is not divided by tensor = 4: heads stay whole, the batch is still split.
    'fsdp2_tensor4_heads_whole': ((1, 2, 4, 1), 2, 6, 3, dict(is_causal=True)),
    # A dense [B, N, T, S] bias and mask follow the batch and head split; d(bias) too.
    'data2_tensor2_dense_bias_mask': ((2, 1, 2, 1), 4, 4, 4, dict(bias=True, mask=True)),
    # A [1, N, T, S] bias (T5's) is shared by the rows: its gradient sums over the batch shards.
    'fsdp4_tensor2_shared_bias': ((1, 4, 2, 1), 4, 4, 2, dict(bias='shared', is_causal=True)),
    # Explicit mesh axes (jax.make_mesh's default): the arrays' types carry their shardings.
    'explicit_data2_fsdp2_tensor2_causal_alibi_gqa': ((2, 2, 2, 1), 4, 4, 2, dict(
        is_causal=True, alibi=True, explicit=True)),
}


def _mesh(shape, explicit=False):
  """A mesh of the `data`, `fsdp`, `tensor`, `sequence` sizes `shape` (the other axes 1)."""
  kind = AxisType.Explicit if explicit else AxisType.Auto
  shape = tuple(shape) + (1,) * (len(sharding.MESH_AXES) - len(shape))
  return jax.make_mesh(shape, sharding.MESH_AXES, axis_types=(kind,) * len(shape))


def _inputs(b, n, k, opts, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  q, key, value, ct = arr(b, T, n, H), arr(b, T, k, H), arr(b, T, k, H), arr(b, T, n, H)
  kw = {o: opts[o] for o in ('is_causal', 'local_window_size') if o in opts}
  if opts.get('alibi'):
    kw['alibi_slopes'] = jnp.asarray(2.0 ** -np.arange(1, n + 1), jnp.float32)
  if opts.get('segments'):
    seg = np.ones((b, T), np.int32)
    seg[:, 14:] = 2
    seg[0, 20:] = 0  # padding in one row
    kw['segment_ids'] = jnp.asarray(seg)
  if opts.get('bias'):
    kw['bias'] = arr(1 if opts['bias'] == 'shared' else b, n, T, T)
  if opts.get('mask'):
    kw['mask'] = jnp.asarray(rng.random((b, 1, T, T)) > 0.3)
  return (q, key, value, ct), kw


def _value_and_grads(q, k, v, ct, kw):
  """The output and the vjp of `ct` w.r.t. q, k, v (and the bias, where there is one)."""
  kw = dict(kw)
  bias = kw.pop('bias', None)

  @quick_jit
  def run(q, k, v, bias, ct):
    out, vjp = jax.vjp(lambda q, k, v, bias: attention.dot_product_attention(
        q, k, v, bias, implementation='pallas', **kw), q, k, v, bias)
    return (out,) + tuple(g for g in vjp(ct) if g is not None)  # no d(bias) without a bias
  return run(q, k, v, bias, ct)


@pytest.mark.parametrize('case', list(CASES))
def test_sharded_pallas_equals_one_device(case):
  shape, b, n, k, opts = CASES[case]
  (q, key, value, ct), kw = _inputs(b, n, k, opts)
  want = _value_and_grads(q, key, value, ct, kw)
  mesh = _mesh(shape, opts.get('explicit', False))
  with jax.set_mesh(mesh):
    if opts.get('explicit'):  # the inputs arrive sharded, as a model's activations would
      q, key, value, ct = (jax.device_put(a, NamedSharding(mesh, P(('data', 'fsdp'))))
                           for a in (q, key, value, ct))
    got = _value_and_grads(q, key, value, ct, kw)
  assert len(got) == (5 if 'bias' in kw else 4)
  for name, w, g in zip(('out', 'dq', 'dk', 'dv', 'dbias'), want, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=TOL, rtol=TOL, err_msg=name)


def test_training_path_use_rules_without_set_mesh():
  """The loop also activates its rules (`sharding.use_rules`): a rules table that sends the heads
  over fsdp and the batch over tensor is what the kernel then follows."""
  (q, key, value, ct), kw = _inputs(4, 4, 4, dict(is_causal=True, alibi=True))
  want = _value_and_grads(q, key, value, ct, kw)
  mesh = _mesh((1, 2, 4, 1))
  rules = sharding.rules_of({'rules': (('heads', 'fsdp'), ('batch', 'tensor'))})
  with sharding.use_rules(mesh, rules):
    got = _value_and_grads(q, key, value, ct, kw)
    text = str(jax.make_jaxpr(lambda q: attention.dot_product_attention(
        q, key, value, implementation='pallas', **kw))(q))
  assert "P('tensor', None, 'fsdp', None)" in text
  for w, g in zip(want, got):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=TOL, rtol=TOL)


def test_on_a_mesh_the_kernel_runs_under_shard_map_with_the_local_shapes(monkeypatch):
  """The kernel sees each device's block: B/4 rows and N/2 heads on data 2 x fsdp 2 x tensor 2,
  with the whole sequence; outside a mesh (and on a one-device mesh) it sees the global arrays."""
  seen = []
  kernel = attention_sharded.per_device(
      lambda q, k, v, bias, mask, **kw: seen.append((q.shape, k.shape)) or q)
  q = jnp.zeros((8, T, 4, H))
  kv = jnp.zeros((8, T, 2, H))
  with jax.set_mesh(_mesh((2, 2, 2, 1))):
    text = str(jax.make_jaxpr(lambda q, k: kernel(q, k, k, scale=1.0))(q, kv))
  assert 'shard_map' in text
  assert seen == [((2, T, 2, H), (2, T, 1, H))]
  seen.clear()
  jax.make_jaxpr(lambda q, k: kernel(q, k, k, scale=1.0))(q, kv)
  with jax.set_mesh(_mesh((1, 1, 1, 1))):
    text = str(jax.make_jaxpr(lambda q, k: kernel(q, k, k, scale=1.0))(q, kv))
  assert 'shard_map' not in text
  assert seen == [((8, T, 4, H), (8, T, 2, H))] * 2


@pytest.mark.parametrize('tensor,n,k,want', [
    (2, 4, 4, ('tensor', 1)),  # K divisible: heads and KV heads split alike
    (2, 4, 1, ('tensor', 2)),  # MQA: the KV head repeated to the 2 shards
    (4, 8, 2, ('tensor', 2)),  # GQA, K < tensor: each KV head twice
    (4, 8, 3, (None, 1)),  # 3 KV heads on 4 shards: neither divides, heads stay whole
    (4, 6, 6, (None, 1)),  # N = 6 not divided by 4
])
def test_layout_splits_heads_where_whole_query_groups_fit(tensor, n, k, want):
  mesh = _mesh((1, 2, tensor, 1))
  batch_axes, head_axes, repeats = attention_sharded.layout(mesh, sharding.DEFAULT_RULES, 4, n, k)
  assert batch_axes == 'fsdp'
  assert (head_axes, repeats) == want


def test_rules_decide_the_split():
  """A rules table that maps 'heads' elsewhere moves the kernel's head split with it."""
  mesh = _mesh((2, 1, 4, 1))
  rules = sharding.rules_of({'rules': (('heads', 'data'), ('batch', 'tensor'))})
  assert attention_sharded.layout(mesh, rules, 8, 4, 4) == ('tensor', 'data', 1)
  # An axis the rules give to both (batch over data x fsdp, heads over tensor x fsdp) is used
  # once, by the batch, which comes first.
  mesh = _mesh((2, 2, 2, 1))
  rules = sharding.rules_of({'rules': (('heads', ('tensor', 'fsdp')),)})
  assert attention_sharded.layout(mesh, rules, 8, 4, 4) == (('data', 'fsdp'), 'tensor', 1)


def test_pallas_with_a_sequence_axis_is_refused_in_one_line():
  from configs import default
  from training import validation
  config = validation.resolve(default.get_config('quick'))
  config.model.attention_impl = 'pallas'
  config.mesh.sequence = 2
  with pytest.raises(options.ConfigError) as e:
    validation.validate(config)
  assert str(e.value).startswith("model.attention_impl='pallas' holds the whole sequence")
  assert 'model.attention_impl in: ring' in str(e.value) and '\n' not in str(e.value)
