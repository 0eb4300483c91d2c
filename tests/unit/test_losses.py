"""training.losses: the vocabulary-tiled output projection and loss equal the plain path, forward
and gradient, in float32, with the final logits' soft cap and PaLM's z-loss too; and a train step
with train.loss_chunk equals one without."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import quick_jit
from training import losses
from training import state as state_lib
from training import steps as steps_lib


def plain(hidden, table, targets, weights):
  logits = jnp.einsum('BTD,VD->BTV', hidden, table)  # [B, T, V]
  return steps_lib.compute_metrics(logits, targets, weights)


@pytest.mark.parametrize('chunk', [1, 7, 20, 30, 50, 64])
def test_tiled_loss_equals_plain_forward_and_gradient(chunk):
  # T_c = 5·C/50 positions a tile: 1 (C 1, 7), 2 and 3 (C 20, 30: the last tile padded), 5, 6
  # (padded beyond the row)
  b, t, d, v = 2, 5, 8, 50
  k = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(k[0], (b, t, d))
  table = jax.random.normal(k[1], (v, d)) * 2.0
  targets = jax.random.randint(k[2], (b, t), 0, v)
  best = jnp.argmax(jnp.einsum('BTD,VD->BTV', hidden, table), -1)
  targets = targets.at[:, ::2].set(best[:, ::2])  # some right, some wrong: accuracy is exercised
  weights = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
  want, got = plain(hidden, table, targets, weights), losses.chunked_metrics(
      hidden, table, targets, weights, chunk)
  for key in ('loss_sum', 'correct_sum', 'weight_sum'):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
  assert float(want['correct_sum']) > 0  # the accuracy path is exercised
  loss = lambda fn: lambda h, w: fn(h, w, targets, weights)['loss_sum']  # noqa: E731
  g_want = jax.grad(loss(plain), (0, 1))(hidden, table)
  g_got = jax.grad(loss(functools.partial(losses.chunked_metrics, chunk=chunk)), (0, 1))(
      hidden, table)
  for a, e in zip(g_got, g_want):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def plain_head(hidden, table, targets, weights, cap, z_loss):
  """The plain path's sums with the soft cap and z-loss, and its objective (training.steps)."""
  logits = cap * jnp.tanh(jnp.einsum('BTD,VD->BTV', hidden, table) / cap)  # [B, T, V]
  sums = steps_lib.compute_metrics(logits, targets, weights)
  sums['z_loss_sum'] = steps_lib.z_loss_sum(logits, weights)
  sums['objective_sum'] = sums['loss_sum'] + z_loss * sums['z_loss_sum']
  return sums


@pytest.mark.parametrize('chunk', [1, 7, 64])
def test_tiled_softcap_and_z_loss_equal_plain_forward_and_gradient(chunk):
  """c = 5 with logits of std 7 (the cap bends them) and z = 0.01 (log Z is about 7: the z-loss
  adds about 0.14 · softmax to the logits' gradient): the sums, and the objective's gradient with
  respect to the hidden states, the table and the weights."""
  b, t, d, v = 2, 5, 8, 50
  cap, z_loss = 5.0, 1e-2
  k = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(k[0], (b, t, d))
  table = jax.random.normal(k[1], (v, d)) * 2.0
  targets = jax.random.randint(k[2], (b, t), 0, v)
  best = jnp.argmax(jnp.einsum('BTD,VD->BTV', hidden, table), -1)
  targets = targets.at[:, ::2].set(best[:, ::2])
  weights = jnp.asarray([[1, 1, 1, 0, 0], [1, 0.5, 1, 1, 1]], jnp.float32)
  tiled = functools.partial(losses.chunked_metrics, chunk=chunk, softcap=cap, z_loss=z_loss)
  want = plain_head(hidden, table, targets, weights, cap, z_loss)
  got = tiled(hidden, table, targets, weights)
  for key in ('loss_sum', 'correct_sum', 'weight_sum', 'z_loss_sum', 'objective_sum'):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
  assert float(want['correct_sum']) > 0
  objective = lambda fn: lambda h, e, w: fn(h, e, targets, w)['objective_sum']  # noqa: E731
  g_want = jax.grad(objective(lambda *a: plain_head(*a, cap, z_loss)), (0, 1, 2))(
      hidden, table, weights)
  g_got = jax.grad(objective(tiled), (0, 1, 2))(hidden, table, weights)
  for a, e in zip(g_got, g_want):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
  # Each part matters: the gradient without the cap or without the z-loss is another.
  for other in (plain_head(hidden, table, targets, weights, 1e6, z_loss),
                plain_head(hidden, table, targets, weights, cap, 0.0)):
    assert abs(float(other['objective_sum'] - want['objective_sum'])) > 0.1
  g_plain = jax.grad(objective(lambda *a: plain_head(*a, cap, 0.0)), (0, 1))(
      hidden, table, weights)
  assert float(jnp.max(jnp.abs(g_plain[0] - g_got[0]))) > 1e-3


def test_tiled_accuracy_takes_the_first_of_tied_maxima():
  hidden = jnp.ones((1, 1, 2))
  table = jnp.asarray([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # ids 1, 2, 3 tie
  for target, correct in ((1, 1.0), (2, 0.0), (3, 0.0)):
    got = losses.chunked_metrics(hidden, table, jnp.asarray([[target]]), jnp.ones((1, 1)), 2)
    assert float(got['correct_sum']) == correct


HEADS = {'plain': (0.0, 0.0), 'softcap_z_loss': (5.0, 1e-2)}  # (final_logit_softcap, z_loss)


@pytest.mark.parametrize('head', list(HEADS))
@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder', 'encoder_only'])
def test_train_step_with_loss_chunk_equals_the_plain_step(data_dir, arch, head):
  from configs import default
  from data import pipeline
  from training import validation
  import models
  cap, z_loss = HEADS[head]
  config = validation.resolve(default.get_config('quick'))
  # The tiles are in the output layer: one block.
  config.model.update(arch=arch, num_layers=1, final_logit_softcap=cap)
  config.data.data_dir = str(data_dir)
  validation.validate(config)
  tokenizer = pipeline.get_tokenizer(config.data)
  batch = next(pipeline.make_iterator(config.data, 'train', config.train.batch_size,
                                      batch_format=models.batch_format(arch)))
  results = []
  for chunk in (0, 48):
    graphdef, tx, state = state_lib.create_state(
        config, tokenizer.vocab_size, special_ids=models.SpecialIds.from_tokenizer(tokenizer))
    step = functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0),
                             loss_chunk=chunk, z_loss=z_loss)
    results.append(quick_jit(step)(dict(state), batch))
  (s0, m0), (s1, m1) = results
  for key in ('loss_sum', 'correct_sum', 'grad_norm') + (('z_loss_sum',) if z_loss else ()):
    np.testing.assert_allclose(m1[key], m0[key], rtol=1e-5)
  # The updates agree: the first step moves every parameter by about the rate (norm ~0.7 here),
  # the two steps' parameters by 1e-4 of that (Adam's normalised update magnifies float noise
  # where a gradient is near zero; a wrong gradient in the tiles moves them by O(update)).
  update = optax.global_norm(jax.tree.map(jnp.subtract, s0['params'], state['params']))
  assert update > 1e-2
  assert optax.global_norm(jax.tree.map(jnp.subtract, s1['params'], s0['params'])) < 1e-3 * update


def test_tiles_cut_the_length_so_each_device_computes_its_own_rows():
  """Under a mesh that splits the batch, the compiled tiled loss holds each device's rows only:
  its logits tiles are [B/P, T_c, V] per device, never the whole batch's (tiles of the flattened
  B·T tokens would sit on one device's rows each, and every device would compute every tile)."""
  p = 4
  devices = np.asarray(jax.devices()[:p])
  mesh = jax.sharding.Mesh(devices, ('data',))
  b, t, d, v, chunk = 8, 12, 16, 48, 16  # T_c = 12·16/48 = 4: 3 tiles
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  k = jax.random.split(jax.random.key(1), 3)
  hidden = jax.device_put(jax.random.normal(k[0], (b, t, d)), rows)
  table = jax.device_put(jax.random.normal(k[1], (v, d)), whole)
  targets = jax.device_put(jax.random.randint(k[2], (b, t), 0, v), rows)
  weights = jax.device_put(jnp.ones((b, t)), rows)

  def loss(h, w):
    return losses.chunked_metrics(h, w, targets, weights, chunk)['loss_sum']

  text = jax.jit(jax.grad(loss, (0, 1))).lower(hidden, table).compile().as_text()
  tc = losses.tile_length(t, v, chunk)
  assert f'f32[{b // p},{tc},{v}]' in text  # a device's tile of logits: its own rows
  assert f'f32[{b},{tc},{v}]' not in text and f'f32[{b * tc},{v}]' not in text
  want = jax.grad(lambda h, w: plain(h, w, targets, weights)['loss_sum'], (0, 1))(
      np.asarray(hidden), np.asarray(table))
  got = jax.jit(jax.grad(loss, (0, 1)))(hidden, table)
  for a, e in zip(got, want):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)
