"""The Flax lm1b/wmt example's model options together (issue #18; each option alone is checked in
tests/unit/test_model_options.py): the model trains five steps at the full rate and, trained, its
cached decode equals its full forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.unit import test_decoding
from tests.unit.test_model_options import V, config_with
from training import state as state_lib
from training import steps as steps_lib

FLAX_STYLE = dict(tie_output=False, embed_scale='none', kernel_init='xavier_uniform', head_dim=12,
                  attention_bias=True, ffn_bias=True, attention_dropout=0.1, ffn_dropout=0.1,
                  dropout=0.1, norm_position='pre')


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_flax_example_style_model_trains_a_step_and_decodes_as_its_forward(arch):
  config = config_with(arch=arch, position='sinusoidal', num_layers=1, **FLAX_STYLE)
  config.train.update(warmup_steps=0, schedule='constant')  # a few steps at the full rate
  graphdef, tx, state = state_lib.create_state(config, V)
  rng = np.random.default_rng(0)
  if arch == 'decoder_only':
    tokens = jnp.asarray(rng.integers(1, V, (4, 12)))
    batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, 1), 'weights': jnp.ones((4, 12))}
  else:
    src, tgt = jnp.asarray(rng.integers(1, V, (4, 10))), jnp.asarray(rng.integers(1, V, (4, 8)))
    batch = {'src_inputs': src, 'tgt_inputs': tgt, 'tgt_targets': jnp.roll(tgt, -1, 1),
             'tgt_weights': jnp.ones((4, 8))}
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0)))
  losses = []
  for _ in range(5):
    state, sums = step(state, batch)
    losses.append(float(sums['loss_sum'] / sums['weight_sum']))
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  # After training, the cached decode equals the full forward (no dropout at decode time).
  model = nnx.merge(graphdef, state['params'])
  if arch == 'decoder_only':
    full, cached = test_decoding.full_and_cached_logits(model, {'inputs': tokens},
                                                        {'inputs': tokens}, tokens)
  else:
    full, cached = test_decoding.full_and_cached_logits(model, batch, {'src_inputs': src}, tgt)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
