"""Sparse, low-rank and kernelised attention variants in training: every variant trains 30 steps
and its loss falls; Performer's feature redraws are checkpointed and resumed (the exactness and
config checks are in tests/unit/test_attention_variants.py)."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from data import pipeline
from layers import linear_attention
import models
from tests import helpers
from training import evaluation
from training import loop
from training import state as state_lib
from training import steps as steps_lib
from training import validation

D, N, K, T = 16, 4, 2, 13  # T not a multiple of any block below; N/K = 2 (GQA)


CAUSAL = ('sliding_window', 'longformer', 'bigbird', 'performer', 'linear')

ALL = CAUSAL + ('linformer',)


def _performer_layers(model):
  return [m for _, m in nnx.iter_modules(model)
          if isinstance(m, linear_attention.PerformerAttention)]


def test_performer_redraw_schedule_is_checkpointed_and_resumed(data_dir, tmp_path):
  """performer_redraw=R: each layer (own seed) holds draw step // R; checkpoints and eval.py carry
  it, and a run resumed between redraws goes on redrawing on schedule."""
  config = helpers.quick_config(data_dir, steps=7, log_every=1, checkpoint_every=3, eval_every=100,
                                diagnostics=False)
  config.model.update(attention='performer', performer_features=16, performer_redraw=2,
                      num_layers=2)
  validation.validate(config)

  def layers_at(workdir, want_step):
    _, graphdef, variables, step = evaluation.load_run(str(workdir))
    assert step == want_step
    return _performer_layers(nnx.merge(graphdef, variables))

  with pytest.raises(KeyboardInterrupt):  # the checkpoint at step 3 holds draw 1
    loop.train_and_evaluate(config, str(tmp_path), hooks=[helpers.interrupt_after(4)])
  for when, draw_number in ((3, 1), (7, 3)):
    if when == 7:
      loop.train_and_evaluate(config, str(tmp_path))  # resumes at 3; redraws at 4 and 6
    layers = layers_at(tmp_path, when)
    assert len(layers) == 2 and layers[0].seed != layers[1].seed
    for layer in layers:
      draw = functools.partial(linear_attention.feature_draw, layer.seed,
                               num_features=16, dim=layer.head_dim)
      np.testing.assert_array_equal(layer.features_w.value, draw(draw_number))
      assert np.abs(draw(draw_number) - draw(0)).max() > 0.1
    assert np.abs(layers[0].features_w.value - layers[1].features_w.value).max() > 0.1
  # Fixed features (R = 0): nothing is ever due.
  config.model.performer_redraw = 0
  graphdef, _, state = state_lib.create_state(config, 166)
  assert state_lib.redraw_features(graphdef, state, 4) is state


def _train_config(data_dir, arch, variant):
  config = default.get_config('quick')
  config.model.arch = arch
  config.model.attention = variant
  config.model.num_layers = 1
  config.model.window = 4
  config.model.bigbird_block = 8
  config.model.bigbird_random_blocks = 1
  config.model.linformer_k = 8
  config.model.performer_features = 32
  config.data.max_length = 40
  config.data.data_dir = str(data_dir)
  config.train.update(steps=30, learning_rate=3e-3, diagnostics=False)
  validation.resolve(config)
  validation.validate(config)
  return config


@pytest.mark.parametrize('arch,variant', [('encoder_only', v) for v in ALL] +
                         [('decoder_only', v) for v in CAUSAL])
def test_variant_trains_and_loss_falls(data_dir, arch, variant):
  """train.py's own state and step on the toy task (no eval/checkpoints: one compile per case)."""
  config = _train_config(data_dir, arch, variant)
  t = config.train
  tokenizer = pipeline.get_tokenizer(config.data)
  graphdef, tx, state = state_lib.create_state(
      config, tokenizer.vocab_size, special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  it = pipeline.make_iterator(config.data, 'train', t.batch_size,
                              batch_format=models.batch_format(config.model.arch),
                              loss_on=t.loss_on)
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0)))
  losses = []
  for _, batch in zip(range(t.steps), it):
    state, sums = step(state, batch)
    losses.append(float(sums['loss_sum'] / sums['weight_sum']))
  first, last = np.mean(losses[:3]), np.mean(losses[-3:])
  assert np.isfinite(last) and last < 0.85 * first, losses
