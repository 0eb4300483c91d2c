"""model.final_logit_softcap (Gemma 2's final logit soft-capping): every architecture's logits are
c·tanh(x / c) of the uncapped model's logits x (same parameters) to float32 rounding of a float64
reference, strictly inside (-c, c), and the loss's gradient is jax.grad of a plain reference that
caps the uncapped logits itself. (The cached decode: test_decoding.py; the tiled loss:
test_losses.py; the checks: test_bad_inputs.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from tests.helpers import quick_jit
from tests.unit.test_decoding import enc_dec_batch
from training import steps as steps_lib
from training import validation
import models

V = 23
CAP = 5.0
ARCHS = ['decoder_only', 'encoder_only', 'encoder_decoder', 'rnn_seq2seq']
SPECIAL = models.SpecialIds(pad=0, bos=1, eos=2, sep=3, mask=4, first_word=5)  # encoder_only's
# The output weights x GAIN: logits of std ~5 and up to about 5c, which the cap bends (and short
# of ~9c, where float32's tanh rounds to 1). An RNN's logits start smaller (std 0.03 at x 1).
GAIN = {'rnn_seq2seq': 30.0, 'untied': 8.0}


def build(arch, cap, **overrides):
  config = validation.resolve(default.get_config())
  config.model.update(arch=arch, num_layers=2, d_model=32, num_heads=4, num_kv_heads=4, d_ff=64,
                      final_logit_softcap=cap, **overrides)
  validation.validate(config)
  return models.build(config.model, V, 16, rngs=nnx.Rngs(0), special_ids=SPECIAL)


def pair(arch, **overrides):
  """(uncapped, capped at CAP) models holding one set of parameters, the output weights (the tied
  embedding or the untied kernel) x GAIN."""
  plain = build(arch, 0.0, **overrides)
  gain = GAIN.get('untied' if overrides.get('tie_output') is False else arch, 4.0)
  for path, node in nnx.iter_graph(plain):
    if isinstance(node, nnx.Param) and (path[-1] == 'embedding' or path[-2:] == ('output',
                                                                                    'kernel')):
      node.set_value(node[...] * gain)
  graphdef, _ = nnx.split(build(arch, CAP, **overrides))
  return plain, nnx.merge(graphdef, nnx.state(plain))


def batch_of(arch):
  """A batch with targets and weights (some zero) in `arch`'s format."""
  if arch in ('decoder_only', 'encoder_only'):
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 5, V)
    weights = jnp.ones((2, 9)).at[1, 6:].set(0.0)
    return {'inputs': tokens, 'targets': jnp.roll(tokens, -1, 1), 'weights': weights}
  batch = enc_dec_batch()
  tgt = batch['tgt_inputs']
  return {**batch, 'tgt_targets': jnp.roll(tgt, -1, 1),
          'tgt_weights': jnp.ones(tgt.shape).at[0, 4:].set(0.0)}


@pytest.mark.parametrize('arch,overrides', [(a, {}) for a in ARCHS]
                         + [('decoder_only', {'tie_output': False})],
                         ids=ARCHS + ['decoder_only-untied'])
def test_logits_are_c_tanh_of_the_uncapped_logits(arch, overrides):
  plain, capped = pair(arch, **overrides)
  for a, b in zip(jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(nnx.state(capped))):
    np.testing.assert_array_equal(a, b)  # one set of parameters
  if arch != 'rnn_seq2seq':
    assert plain.output_softcap() == 0.0 and capped.output_softcap() == CAP
  batch = batch_of(arch)
  (plain_def, plain_state), (capped_def, capped_state) = nnx.split(plain), nnx.split(capped)
  raw, got = quick_jit(lambda p, c, batch: (nnx.merge(plain_def, p)(batch),
                                            nnx.merge(capped_def, c)(batch)))(
                                                plain_state, capped_state, batch)  # [B, T, V]
  raw = np.asarray(raw, np.float64)
  assert 3 * CAP < np.max(np.abs(raw)) < 8 * CAP  # well past the cap, short of float32's tanh = 1
  want = CAP * np.tanh(raw / CAP)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)
  assert np.max(np.abs(got)) < CAP
  assert np.max(np.abs(got - raw)) > 1.0  # the cap changed the logits


def _ce_sum(logits, targets, weights):
  """sum of w · cross-entropy, written out: -log softmax(logits)[target]."""
  logp = jax.nn.log_softmax(logits, -1)  # [B, T, V]
  return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * weights)


@pytest.mark.parametrize('arch', ARCHS)
def test_the_loss_gradient_goes_through_the_cap(arch):
  """jax.grad of the capped model's loss (training.steps.compute_metrics of `loss_terms`) equals
  jax.grad of the uncapped model's logits capped by hand, and differs from the uncapped
  gradient."""
  plain, capped = pair(arch)
  plain_def, state = nnx.split(plain)
  capped_def, _ = nnx.split(capped)
  batch = batch_of(arch)

  def model_loss(state):
    model = nnx.merge(capped_def, state)
    return steps_lib.compute_metrics(*model.loss_terms(batch))['loss_sum']

  def reference_loss(state, cap):
    logits, targets, weights = nnx.merge(plain_def, state).loss_terms(batch)
    return _ce_sum(cap * jnp.tanh(logits / cap) if cap else logits, targets, weights)

  got, want, uncapped = quick_jit(lambda s: (jax.grad(model_loss)(s),
                                             jax.grad(reference_loss)(s, CAP),
                                             jax.grad(reference_loss)(s, 0.0)))(state)
  diffs, gaps = [], []
  for g, w, u in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(uncapped)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    diffs.append(float(jnp.max(jnp.abs(g - w))))
    gaps.append(float(jnp.max(jnp.abs(g - u))))
  assert max(gaps) > 1e-2, gaps  # the cap is in the gradient
