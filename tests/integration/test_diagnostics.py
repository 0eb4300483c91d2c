"""Training diagnostics (train.py): per-layer gradient norms and update ratios, attention max logit
and entropy, activation RMS, and the files a run writes (init_grad_norms.json, run_info.json)."""

from tests.helpers import tiny_config
import json
import math

import pytest

from training import loop

VOCAB, B, T = 50, 4, 16


def test_a_run_logs_diagnostics_and_writes_its_reports(data_dir, tmp_path):
  config = tiny_config()
  config.data.data_dir = str(data_dir)
  config.train.update(steps=2, log_every=1, eval_every=100, checkpoint_every=100, warmup_steps=0)
  loop.train_and_evaluate(config, str(tmp_path / 'run'))
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  train_rows = [r for r in rows if r['split'] == 'train']
  assert [r['step'] for r in train_rows] == [1, 2]
  for key in ('grad_norm/decoder/blocks/2', 'update_ratio/decoder/embed', 'update_ratio',
              'attn_max_logit/decoder/blocks/0', 'attn_entropy/decoder/blocks/1',
              'act_rms/decoder/blocks/2'):
    assert math.isfinite(train_rows[0][key]), key
  with open(tmp_path / 'run' / 'init_grad_norms.json') as f:
    init = json.load(f)
  assert len(init['blocks']) == 3 and init['norm_position'] == 'pre'
  assert init['blocks'][0] == pytest.approx(train_rows[0]['grad_norm/decoder/blocks/0'])
  assert init['grad_norm'] == pytest.approx(train_rows[0]['grad_norm'], rel=1e-5)
  with open(tmp_path / 'run' / 'run_info.json') as f:
    info = json.load(f)
  assert info['num_params'] == sum(info['params_by_group'].values())
  assert 0 < info['unigram_entropy'] < 10
