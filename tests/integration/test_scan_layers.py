"""Scanned layers (model.scan_layers, models/stack.py): the same parameters give the unrolled
model's logits and gradients under every remat policy; the stacked parameters keep their logical
axes, per-layer diagnostics and attention maps; a scanned model trains; bad configs are refused."""


import numpy as np

from training import validation
from tests.helpers import metric_rows, quick_config
from training import loop

V, L = 23, 2
# Positions applied inside attention (T5 bias, RoPE) are closed over by the scanned block body:
# their gradients must leave the scan as well.


def test_a_few_scanned_steps_lower_the_loss_with_diagnostics(data_dir, tmp_path):
  config = quick_config(data_dir, steps=20, log_every=5, learning_rate=3e-3, diagnostics=True,
                        eval_every=100, checkpoint_every=100)
  config.model.update(scan_layers=True, remat='full')
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path))
  rows = {r['step']: r for r in metric_rows(tmp_path)}
  assert rows[20]['loss'] < 0.8 * rows[5]['loss'], {s: r['loss'] for s, r in rows.items()}
  # Per-layer reports of the scanned stack, as an unrolled run writes them.
  for key in ('grad_norm/decoder/blocks/1', 'attn_entropy/decoder/blocks/1',
              'act_rms/decoder/blocks/0'):
    assert np.isfinite(rows[5][key]) and rows[5][key] > 0, key
