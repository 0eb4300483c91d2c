"""train.z_loss (PaLM's z-loss, Chowdhery et al. 2022): the step's z term is the weighted mean of
(log Z)² of a float64 reference, the objective is the loss plus z times it, the reported loss is
the plain cross-entropy, and the gradient is the reference objective's; the log rows carry its
mean, and a checkpointed log window from before it existed resumes. (The tiled loss:
test_losses.py; the checks: test_bad_inputs.py; through train.py:
tests/integration/test_softcap_z_loss.py.)"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import decoder_only
from data import pipeline
from tests.helpers import interrupt_after, metric_rows, quick_config, quick_jit
from tests.unit.test_softcap import batch_of, build
from training import loop
from training import state as state_lib
from training import steps as steps_lib
from training import validation

Z = 1e-2  # large enough that the gradient's z part shows (2z · log Z ≈ 0.08 of the softmax term)


def reference(logits, targets, weights):
  """(sum of w · cross-entropy, weighted mean of (log Z)²) in float64 numpy."""
  x, w = np.asarray(logits, np.float64), np.asarray(weights, np.float64)
  m = np.max(x, -1, keepdims=True)
  log_z = (m + np.log(np.sum(np.exp(x - m), -1, keepdims=True)))[..., 0]  # [B, T]
  target = np.take_along_axis(x, np.asarray(targets)[..., None], -1)[..., 0]  # [B, T]
  return np.sum((log_z - target) * w), np.sum(np.square(log_z) * w) / np.sum(w)


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_step_sums_add_z_times_the_mean_log_z_squared(arch):
  model = build(arch, 0.0)
  graphdef, state = nnx.split(model)
  batch = batch_of(arch)  # weights with zeros (padding)

  def sums_and_grad(state, z_loss):
    def objective(state):
      sums = steps_lib.step_sums(nnx.merge(graphdef, state), batch, None, z_loss=z_loss)
      return sums['objective_sum'] / sums['weight_sum'], sums
    grad, sums = jax.grad(objective, has_aux=True)(state)
    return sums, grad

  def reference_objective(state):
    logits, targets, weights = nnx.merge(graphdef, state).loss_terms(batch)
    log_z = jax.nn.logsumexp(logits, -1)  # [B, T]
    ce = log_z - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.sum((ce + Z * jnp.square(log_z)) * weights) / jnp.sum(weights)

  (with_z, grad), (without, grad0), want_grad, terms = quick_jit(
      lambda s: (sums_and_grad(s, Z), sums_and_grad(s, 0.0), jax.grad(reference_objective)(s),
                 nnx.merge(graphdef, s).loss_terms(batch)))(state)
  loss, mean_sq = reference(*terms)
  np.testing.assert_allclose(with_z['z_loss_sum'] / with_z['weight_sum'], mean_sq, rtol=1e-6)
  np.testing.assert_allclose(with_z['objective_sum'],
                             with_z['loss_sum'] + Z * with_z['z_loss_sum'], rtol=1e-6)
  np.testing.assert_allclose(with_z['objective_sum'], loss + Z * mean_sq * np.sum(terms[2]),
                             rtol=1e-6)
  np.testing.assert_allclose(with_z['loss_sum'], loss, rtol=1e-6)
  np.testing.assert_array_equal(with_z['loss_sum'], without['loss_sum'])  # the plain CE
  assert 'z_loss_sum' not in without and mean_sq > 1.0
  gaps = []
  for g, w, g0 in zip(jax.tree.leaves(grad), jax.tree.leaves(want_grad), jax.tree.leaves(grad0)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    gaps.append(float(jnp.max(jnp.abs(g - g0))))
  assert max(gaps) > 1e-3, gaps  # the z-loss is in the gradient


def test_train_step_reports_the_plain_loss_and_steps_on_the_objective():
  """train_step with z_loss: the same loss_sum as without, a z_loss_sum beside it, and another
  gradient and update."""
  config = validation.resolve(decoder_only.get_config('quick'))
  config.model.update(num_layers=1)
  config.train.warmup_steps = 0  # the first step at the full rate: an update to compare
  validation.validate(config)
  graphdef, tx, state = state_lib.create_state(config, 23)  # batch_of's V
  batch = batch_of('decoder_only')
  step = lambda z: quick_jit(lambda state: steps_lib.train_step(  # noqa: E731
      graphdef, tx, jax.random.key(0), state, batch, z_loss=z))(state)
  (s0, m0), (s1, m1) = step(0.0), step(Z)
  np.testing.assert_array_equal(m1['loss_sum'], m0['loss_sum'])
  assert 'z_loss_sum' not in m0 and float(m1['z_loss_sum']) > 0
  assert abs(float(m1['grad_norm'] - m0['grad_norm'])) > 1e-4
  assert float(optax.global_norm(jax.tree.map(jnp.subtract, s1['params'], s0['params']))) > 0


def _strip_window(workdir, step, key):
  """Removes `key` from checkpoint `step`'s log window, as a checkpoint from before it existed."""
  path = workdir / 'checkpoints' / str(step) / 'window' / 'metadata'
  window = json.loads(path.read_text())
  assert key in window
  del window[key]
  path.write_text(json.dumps(window))


def test_rows_log_the_mean_and_an_older_window_resumes(data_dir, tmp_path):
  """Three steps with a soft cap and the z-loss, one row: its z_loss is the mean (log Z)². A run
  killed after step 3 whose checkpoint (step 2) holds a window without the z-loss sum resumes: the
  row's loss is the uninterrupted one, its z_loss counts step 3 alone (the default 0 carried)."""
  config = quick_config(data_dir, steps=3, log_every=3, checkpoint_every=2, eval_every=1000,
                        warmup_steps=0, z_loss=1e-4)
  config.model.final_logit_softcap = 30.0
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path / 'full'))
  with pytest.raises(KeyboardInterrupt):
    loop.train_and_evaluate(config, str(tmp_path / 'cut'), hooks=[interrupt_after(3)])
  _strip_window(tmp_path / 'cut', 2, steps_lib.Z_LOSS_SUM)
  loop.train_and_evaluate(config, str(tmp_path / 'cut'))
  (full,), (cut,) = metric_rows(tmp_path / 'full'), metric_rows(tmp_path / 'cut')
  assert full['step'] == cut['step'] == 3
  np.testing.assert_allclose(cut['loss'], full['loss'], rtol=1e-6)
  # Untrained logits near 0: log Z near log V, (log Z)² near 26 for the toy task's V = 166.
  log_v = np.log(pipeline.get_tokenizer(config.data).vocab_size)
  assert 0.5 * log_v ** 2 < full['z_loss'] < 2 * log_v ** 2
  assert 0 < cut['z_loss'] < 0.6 * full['z_loss']  # one step's sum of three
