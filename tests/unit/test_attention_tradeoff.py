"""The efficient-attention study: a decoder variant of its own (Linformer encoders) and the
trade-off
table and picture (tools/attention_tradeoff.py)."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from layers import options
from tools import attention_tradeoff
from configs import default
from training import validation
from tests.unit import test_decoding
import models


def enc_dec_config(**model):
  config = validation.resolve(default.get_config())
  config.data.max_length = 16
  config.model.update({'arch': 'encoder_decoder', 'num_layers': 2, 'd_model': 32,
                       'num_heads': 4, 'd_ff': 64, **model})
  return config


def test_linformer_encoder_pairs_with_a_dense_decoder_and_decodes_from_the_cache():
  config = enc_dec_config(attention='linformer', decoder_attention='dense', linformer_k=4,
                          linformer_length=16)
  validation.validate(config)
  model = models.build(config.model, test_decoding.V, 16, rngs=nnx.Rngs(0))
  assert type(model.encoder.blocks[0].self_attention).__name__ != type(
      model.decoder.blocks[0].self_attention).__name__
  batch = test_decoding.enc_dec_batch()
  src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
  full, step = test_decoding.full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


def test_decoder_attention_default_is_the_encoders():
  config = enc_dec_config(attention='sliding_window', window=3)
  validation.validate(config)
  model = models.build(config.model, test_decoding.V, 16, rngs=nnx.Rngs(0))
  assert type(model.decoder.blocks[0].self_attention).__name__ == type(
      model.encoder.blocks[0].self_attention).__name__


@pytest.mark.parametrize('overrides,message', [
    (dict(attention='linformer'), 'or set model.decoder_attention'),
    (dict(attention='linformer', decoder_attention='linformer'),
     "model.decoder_attention='linformer' is not causal; valid values: '', "),
    (dict(decoder_attention='nope'), "model.decoder_attention='nope'"),
    (dict(arch='decoder_only', decoder_attention='dense'), "read only by model.arch='encoder_de"),
])
def test_decoder_attention_errors_name_the_field_and_valid_values(overrides, message):
  config = enc_dec_config(**overrides)
  with pytest.raises(options.ConfigError, match=message.replace('(', r'\(')):
    validation.validate(config)


def _write_cell(sweep_dir, name, val_loss, test_em, long_em):
  os.makedirs(os.path.join(sweep_dir, name))
  with open(os.path.join(sweep_dir, name, 'eval.json'), 'w') as f:
    json.dump({'loss': {'validation': val_loss},
               'translation': {'test': {'exact_match': test_em},
                               'test_long': {'exact_match': long_em}}}, f)


def test_tradeoff_table_aggregates_seeds_and_extrapolates_unrun_dense(tmp_path):
  sweep_dir = str(tmp_path / 'sweep')
  for seed, loss in enumerate((1.0, 1.2, 1.4)):
    _write_cell(sweep_dir, f'model.attention=dense,seed={seed}', loss, 1.0, 0.5)
  _write_cell(sweep_dir, 'model.attention=linformer,model.decoder_attention=dense,seed=0',
              2.0, 0.25, 0.0)
  os.makedirs(os.path.join(sweep_dir, 'model.attention=linear,seed=0'))  # unfinished: skipped
  for seed in (0, 1):
    os.makedirs(os.path.join(sweep_dir, f'model.attention=performer,seed={seed}'))
    with open(os.path.join(sweep_dir, f'model.attention=performer,seed={seed}', 'train.log'),
              'w') as f:
      f.write('train: non-finite grad_norm (nan) at step 141; stopping.\n')
  rows = []
  for kernel, secs in (('dense', {1024: 1.0, 4096: 16.0, 16384: None}),
                       ('dense_flash', {1024: 0.5, 4096: 4.0, 16384: 60.0}),
                       ('linformer', {1024: 0.1, 4096: 0.4, 16384: 1.6})):
    rows += [{'variant': kernel, 'length': t, 'mode': 'fwd_bwd', 'seconds': s,
              'temp_bytes': 2 ** 20 * t // 1024} for t, s in secs.items()]
  costs = str(tmp_path / 'costs.json')
  with open(costs, 'w') as f:
    json.dump({'rows': rows}, f)

  quality = attention_tradeoff.read_quality(sweep_dir)
  assert sorted(quality) == ['dense', 'linformer', 'performer']
  assert quality['performer']['diverged'] == 2 and not quality['performer']['val_loss']
  points = attention_tradeoff.points(quality, attention_tradeoff.read_costs(costs), 16384)
  by_label = {p[0]: p for p in points}
  # Dense xla at 16k was not run: 4k's 16 s scaled by (16k/4k)^2, marked unmeasured.
  assert by_label['dense (xla)'][3:] == (256.0, False)
  assert by_label['dense (blockwise)'][3:] == (60.0, True)
  assert by_label['linformer (decoder: dense)'][3:] == (1.6, True)
  text = attention_tradeoff.table(points, attention_tradeoff.read_costs(costs))
  assert '| dense (xla) | 3 | 1.2000 [1.0000, 1.4000] | 100.0 [100.0, 100.0] |' in text
  assert '| performer | 2 | 2 of 2 seeds diverged (non-finite gradient) | n/a |' in text
  assert '~256 (T² extrapolated)' in text
  out = str(tmp_path / 'tradeoff.png')
  attention_tradeoff.main([f'--sweep_dir={sweep_dir}', f'--costs={costs}', f'--out={out}'])
  assert os.path.getsize(out) > 10_000
