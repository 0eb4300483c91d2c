"""model.attention_gate and model.qk_norm through train.py: two steps train with each on (xla
kernel), the train rows carry each block's attn_sink_share beside attn_entropy, and a bad value
exits 2 with one line. (The numbers: tests/unit/test_gate_qknorm.py.)"""

import math
import subprocess
import sys

import pytest

from tests.helpers import ROOT, metric_rows

BASE = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
        '--config.train.steps=2', '--config.train.warmup_steps=0', '--config.train.log_every=1',
        '--config.train.eval_every=2', '--config.train.checkpoint_every=2',
        '--config.model.attention_impl=xla', '--config.train.diagnostics=True']


@pytest.mark.parametrize('flags', [
    ['--config.model.attention_gate=elementwise'],
    ['--config.model.qk_norm=rmsnorm', '--config.model.attention_gate=headwise'],
], ids=['elementwise-gate', 'qk-norm-headwise-gate'])
def test_train_py_trains_two_steps_with_them(data_dir, tmp_path, flags):
  out = subprocess.run(
      BASE + flags + [f'--workdir={tmp_path}', f'--config.data.data_dir={data_dir}'], cwd=ROOT,
      capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2]
  for row in rows:
    assert math.isfinite(row['loss']) and row['loss'] > 0
    sinks = {k: v for k, v in row.items() if k.startswith('attn_sink_share/')}
    assert sinks and len(sinks) == len([k for k in row if k.startswith('attn_entropy/')]), row
    assert all(0 < v <= 1 for v in sinks.values()), sinks
  assert math.isfinite(metric_rows(tmp_path, 'valid')[0]['loss'])


def test_an_unknown_gate_exits_2_with_one_line(data_dir, tmp_path):
  out = subprocess.run(BASE + ['--config.model.attention_gate=sigmoid',
                               f'--workdir={tmp_path / "w"}', f'--config.data.data_dir={data_dir}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1].endswith(
      "model.attention_gate='sigmoid' is not valid; valid values: elementwise, headwise, none"), (
          out.stderr)
  assert not (tmp_path / 'w').exists()
