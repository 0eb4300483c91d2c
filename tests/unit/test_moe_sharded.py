"""Dropless MoE under expert parallelism (layers/moe_sharded.py) on 8 simulated CPU devices: the
shard_map path gives the one-device output and gradients, and the static all-to-all moves rows
where jax.lax.ragged_all_to_all would."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from layers import moe
from layers import moe_sharded
from layers import sharding
from tests.helpers import quick_jit

D, F = 8, 16
B, T = 8, 6  # 8 rows: one per device under data 2 x fsdp 2 x expert 2


def mesh_of(**sizes):
  return sharding.make_mesh(ml_collections.ConfigDict(sizes))


def loss_and_grads(m, x, mesh=None):
  """Dropless token choice (C = 0: no capacity), a loss of its output and the gradients of the
  experts, the router and the input, compiled once; under `mesh` with the default rules."""
  graphdef, params = nnx.split(m, nnx.Param)

  def loss(params, x):
    y = nnx.merge(graphdef, params)(x, nnx.Rngs(dropout=0))  # training: rngs given
    return jnp.sum(jnp.sin(y)), y

  def run(params, x):
    if mesh is None:
      return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
    with sharding.use_rules(mesh, sharding.DEFAULT_RULES):
      return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)

  if mesh is not None:
    specs = sharding.param_specs(params, mesh, sharding.DEFAULT_RULES)
    params = jax.device_put(params, sharding.named(specs, mesh))
    x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P(('data', 'fsdp', 'expert'))))
  (value, y), grads = quick_jit(run)(params, x)
  return value, y, grads


@pytest.mark.parametrize('ffn,experts,top_k', [('relu', 4, 2), ('swiglu', 8, 3)])
def test_expert_parallel_dropless_equals_one_device(ffn, experts, top_k):
  """expert 2 x fsdp 2 x data 2: output, loss and every gradient are the one-device ones."""
  m = moe.MoE(D, F, experts, ffn, top_k=top_k, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
  one = loss_and_grads(m, x)
  mesh = mesh_of(data=2, fsdp=2, expert=2)
  sharded = loss_and_grads(m, x, mesh)
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_the_sharded_path_is_the_one_that_runs():
  """On the mesh the program holds the shard_map and its all-to-alls; without one, neither."""
  m = moe.MoE(D, F, 4, 'relu', top_k=2, rngs=nnx.Rngs(0))
  x = jnp.ones((B, T, D), jnp.float32)
  graphdef, state = nnx.split(m)
  fn = lambda state, x: nnx.merge(graphdef, state)(x, sow=False)  # noqa: E731
  mesh = mesh_of(data=2, fsdp=2, expert=2)
  with sharding.use_rules(mesh, sharding.DEFAULT_RULES):
    text = str(jax.make_jaxpr(fn)(state, x))
  assert 'shard_map' in text and 'all_to_all' in text
  one = lambda state, x: fn(state, x)  # noqa: E731  a new function: make_jaxpr caches by function
  assert 'shard_map' not in str(jax.make_jaxpr(one)(state, x))


def test_layout_needs_the_expert_axis_on_the_tokens_and_the_experts():
  mesh = mesh_of(data=2, fsdp=2, expert=2)
  tokens, axes = moe_sharded.layout(mesh, sharding.DEFAULT_RULES, (B, T, D), 4)
  assert axes == ('expert',) and tokens == P(('data', 'fsdp', 'expert'), None, None)
  # Three experts: the expert axis cannot split them, GSPMD keeps the dropless path.
  assert moe_sharded.layout(mesh, sharding.DEFAULT_RULES, (B, T, D), 3) is None
  # Rows not split over the expert axis: every expert device holds the same tokens.
  rules = dict(sharding.DEFAULT_RULES, batch=('data', 'fsdp'))
  assert moe_sharded.layout(mesh, tuple(rules.items()), (B, T, D), 4) is None


def test_static_all_to_all_moves_rows_where_the_ragged_one_would():
  """jax.lax.ragged_all_to_all's documented semantics by hand on 4 devices: sender i's rows
  operand_i[in_off_i[j] : + send_i[j]] land at output_j[out_off_i[j] : + send_i[j]]."""
  p, n, cap = 4, 6, 3
  rng = np.random.default_rng(0)
  send = rng.integers(0, cap + 1, (p, p)).astype(np.int32)  # [sender, receiver]
  operand = rng.normal(size=(p, n, 2)).astype(np.float32)
  # Each run starts anywhere that keeps it in the sender's rows (they may overlap).
  in_off = np.stack([[rng.integers(0, n - s + 1) for s in row] for row in send]).astype(np.int32)
  out_off = (np.cumsum(send, 0) - send).astype(np.int32)  # receiver j: senders in order
  want = np.zeros((p, p * cap, 2), np.float32)
  for i in range(p):
    for j in range(p):
      rows = operand[i, in_off[i, j]:in_off[i, j] + send[i, j]]
      want[j, out_off[i, j]:out_off[i, j] + send[i, j]] = rows
  mesh = jax.make_mesh((p,), ('x',), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:p])

  def per_device(operand, in_off, send, out_off, recv):
    out = jnp.zeros((p * cap, 2), jnp.float32)
    return moe_sharded.static_all_to_all(operand[0], out, in_off[0], send[0], out_off[0],
                                         recv[0], axis_name='x', cap=cap)[None]

  got = quick_jit(jax.shard_map(per_device, mesh=mesh, in_specs=P('x'), out_specs=P('x')))(
      operand, in_off, send, out_off, send.T.copy())
  np.testing.assert_array_equal(np.asarray(got), want)


def test_kept_counts_clip_each_receiver_in_arrival_order():
  counts = np.array([[[3, 1], [2, 0]], [[1, 2], [4, 4]]], np.int32)  # [sender, receiver, expert]
  kept = np.asarray(moe_sharded.kept_counts(jnp.asarray(counts), 5))
  # Receiver 0 gets 3, 1 (sender 0), then 1, 2 (sender 1): room for 5 keeps 3, 1, 1, 0.
  # Receiver 1 gets 2, 0, then 4, 4: keeps 2, 0, 3, 0.
  np.testing.assert_array_equal(kept, [[[3, 1], [2, 0]], [[1, 0], [3, 0]]])
  np.testing.assert_array_equal(moe_sharded.kept_counts(jnp.asarray(counts), 16), counts)


def _dropped_reference(top_i, experts, buffer, group=2, rows_per_device=1):
  """Which assignments a receive buffer of `buffer` rows keeps, by the rule written out: tokens
  split over 8 devices in row order (data, fsdp, expert), expert groups of `group` devices (the
  expert axis is last), each sender's assignments sorted by expert (stably), each receiver taking
  senders in order and each sender's rows by expert until its buffer is full."""
  top_i = np.asarray(top_i)
  kept = np.zeros(top_i.shape, bool)
  local = experts // group
  devices = top_i.shape[0] // rows_per_device
  for first in range(0, devices, group):  # one expert group: devices first .. first + group - 1
    room = {j: buffer for j in range(group)}
    for sender in range(group):
      rows = slice((first + sender) * rows_per_device, (first + sender + 1) * rows_per_device)
      flat = top_i[rows].reshape(-1)
      for idx in np.argsort(flat, kind='stable'):
        receiver = flat[idx] // local
        if room[receiver] > 0:
          room[receiver] -= 1
          kept[rows].reshape(-1)[idx] = True  # a view: rows of one device are contiguous
  return kept


def _experts_by_hand(xp, x, wi, wo, top_i, w):
  """Each token's chosen ReLU experts, weighted by `w` `[B, T, k]` and summed, in `xp` (jnp for
  gradients, np for a float64 forward): the reference the sharded path is held to."""
  h = xp.maximum(xp.einsum('BTD,BTKDF->BTKF', x, wi[top_i]), 0)
  return xp.einsum('BTKD,BTK->BTD', xp.einsum('BTKF,BTKFD->BTKD', h, wo[top_i]), w)


def test_a_receive_buffer_drops_the_overflow_and_counts_it():
  """moe_buffer_factor 1: each device receives at most T·k assignments; the sharded output and
  gradients equal a one-device computation with exactly the assignments the rule drops removed,
  and drop_fraction is their share."""
  m = moe.MoE(D, F, 4, 'relu', top_k=2, buffer_factor=1.0, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
  logits = jnp.einsum('BTD,DE->BTE', x, m.router[...])
  _, top_i = jax.lax.top_k(jax.nn.softmax(logits, -1), 2)
  keep = _dropped_reference(top_i, 4, T * 2)
  assert 0 < (~keep).sum() < keep.size  # the routing overflows some buffer, not all

  def reference(params, x):
    model = nnx.merge(graphdef, params)
    probs = jax.nn.softmax(jnp.einsum('BTD,DE->BTE', x, model.router[...]), -1)
    top_p = jnp.take_along_axis(probs, top_i, -1)
    w = top_p / jnp.sum(top_p, -1, keepdims=True) * keep
    return jnp.sum(jnp.sin(_experts_by_hand(jnp, x, model.wi[...], model.wo[...], top_i, w)))

  graphdef, params = nnx.split(m, nnx.Param)
  want = jax.value_and_grad(reference, (0, 1))(params, x)
  value, _, grads = loss_and_grads(m, x, mesh_of(data=2, fsdp=2, expert=2))
  np.testing.assert_allclose(value, want[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)

  mesh = mesh_of(data=2, fsdp=2, expert=2)
  with sharding.use_rules(mesh, sharding.DEFAULT_RULES):
    _, stats = jax.jit(lambda x, l: m.token_choice(x, l, buffer_factor=1.0))(x, logits)
  np.testing.assert_allclose(stats['drop_fraction'], (~keep).mean(), rtol=1e-6)


# Each device's 6 tokens' (first, second) experts, E = 4 on expert 2: experts 0-1 on the first
# device of each expert group, 2-3 on the second; one row per device under data 2 x fsdp 2.
CROWDED = np.array([
    [(0, 1), (1, 0), (0, 1), (0, 2), (3, 0), (2, 3)],  # group 0, sender 0: 8 rows to receiver 0
    [(0, 1), (1, 0), (0, 2), (3, 0), (0, 2), (0, 3)],  # sender 1: 6 + 2 rows to 0 (4 fit), 4 to 1
    [(2, 3), (3, 2), (2, 3), (2, 3), (2, 0), (3, 1)],  # group 1, sender 0: 10 rows to receiver 1
    [(3, 2), (3, 2), (2, 3), (2, 0), (3, 1), (1, 0)],  # sender 1: 4 + 4 to 1 (2 fit), 4 to 0
    [(0, 2), (1, 3), (0, 2), (1, 3), (0, 2), (1, 3)],  # group 2: balanced, nothing dropped
    [(2, 0), (3, 1), (2, 0), (3, 1), (2, 0), (3, 1)],
    [(0, 1)] * 6,  # group 3: both senders' 12 rows to receiver 0, the second's all dropped
    [(1, 0)] * 6,
], np.int32)


@pytest.mark.parametrize('sizes,rows_per_device', [
    (dict(data=2, fsdp=2, expert=2), 1),
    (dict(data=2, expert=2, tensor=2), 2),  # the tensor axis replicates the tokens
])
def test_a_crowded_receive_buffer_keeps_each_runs_prefix(sizes, rows_per_device):
  """Overflow mid-run: a sender's run cut inside one expert with a later run to another device
  behind it, a run dropped whole, an empty receiver. The sharded output, its gradients and the
  kept count equal a float64 computation of exactly the assignments the rule keeps; the kept
  count is not multiplied by axes that replicate the tokens."""
  m = moe.MoE(D, F, 4, 'relu', top_k=2, rngs=nnx.Rngs(0))
  params = m.expert_params(jnp.float32)
  x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
  weights = jax.random.uniform(jax.random.key(2), (B, T, 2), jnp.float32, 0.1, 1.0)
  keep = _dropped_reference(CROWDED, 4, T * 2 * rows_per_device, rows_per_device=rows_per_device)
  if rows_per_device == 1:  # the case as laid out above
    np.testing.assert_array_equal((~keep).sum((1, 2)), [0, 4, 0, 6, 0, 0, 0, 12])
  assert 0 < (~keep).sum() < keep.size

  def sharded(x, params):
    y, kept = moe_sharded.dropless(x, jnp.asarray(CROWDED), weights, params, m.grouped_experts,
                                   4, buffer_factor=1.0)
    return jnp.sum(jnp.sin(y)), (y, kept)

  def reference(x, params):
    return jnp.sum(jnp.sin(_experts_by_hand(jnp, x, params['wi'], params['wo'], CROWDED,
                                            weights * keep)))

  with sharding.use_rules(mesh_of(**sizes), sharding.DEFAULT_RULES):
    (_, (y, kept)), grads = quick_jit(jax.value_and_grad(sharded, (0, 1), has_aux=True))(
        x, params)
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  want = _experts_by_hand(np, f64(x), f64(params['wi']), f64(params['wo']), CROWDED,
                          f64(weights) * keep)
  np.testing.assert_allclose(np.asarray(y), want, atol=1e-5, rtol=1e-5)
  assert int(kept) == keep.sum()
  want_grads = jax.grad(reference, (0, 1))(x, params)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_evaluation_keeps_the_worst_case_buffer():
  """Without rngs (evaluation, decoding) `buffer_factor` does not apply: the routing that
  overflows a training buffer above (4 assignments) gives the one-device output, nothing dropped."""
  m = moe.MoE(D, F, 4, 'relu', top_k=2, buffer_factor=1.0, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.float32)
  graphdef, state = nnx.split(m)

  def fn(state, x):
    y, sown = nnx.capture(lambda m: m(x), nnx.Intermediate)(nnx.merge(graphdef, state))
    return y, {jax.tree_util.keystr(k): v for k, v in jax.tree.leaves_with_path(sown)}

  one = lambda state, x: fn(state, x)  # noqa: E731  a new function: jit caches by function
  want = quick_jit(one)(state, x)[0]  # one device: no buffer
  with sharding.use_rules(mesh_of(data=2, fsdp=2, expert=2), sharding.DEFAULT_RULES):
    y, sown = quick_jit(fn)(state, x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=1e-5, rtol=1e-5)
  [drop] = [v for k, v in sown.items() if 'drop_fraction' in k]
  assert float(drop) == 0.0
