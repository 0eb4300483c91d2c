"""Sparse, low-rank and kernelised attention variants: exact against explicit masks, approximations
improve where they should, every variant trains, impossible configs are rejected in one line."""

import functools

import numpy as np
import pytest
from flax import nnx

from training import validation
from layers import linear_attention
from tests import helpers
from training import evaluation
from training import loop
from training import state as state_lib

D, N, K, T = 16, 4, 2, 13  # T not a multiple of any block below; N/K = 2 (GQA)


CAUSAL = ('sliding_window', 'longformer', 'bigbird', 'performer', 'linear')


def _performer_layers(model):
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, linear_attention.PerformerAttention)]


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
