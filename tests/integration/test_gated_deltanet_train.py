"""model.attention='gated_deltanet' through the command lines: train.py trains two steps, eval.py
decodes the test split with the recurrent cache and draws the implied attention maps, and a bad
value exits 2 with one line before anything compiles. (The numbers:
tests/unit/test_gated_deltanet.py.)"""

import json
import math
import os
import subprocess
import sys

from tests.helpers import ROOT, metric_rows
from tests.integration.test_eval import check_decoder_only_eval

BASE = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
        '--config.model.attention=gated_deltanet', '--config.model.position=rope',
        '--config.model.deltanet_chunk=16', '--config.train.steps=2',
        '--config.train.warmup_steps=0', '--config.train.log_every=1',
        '--config.train.eval_every=2', '--config.train.checkpoint_every=2']


def test_train_two_steps_then_eval_decodes_with_the_cache(data_dir, tmp_path):
  out = subprocess.run(BASE + [f'--workdir={tmp_path}', f'--config.data.data_dir={data_dir}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2]
  assert all(math.isfinite(r['loss']) and r['loss'] > 0 for r in rows)
  out = subprocess.run([sys.executable, 'eval.py', f'--workdir={tmp_path}', '--split=test',
                        '--max_examples=6', '--plot_attention=1'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(tmp_path, 'eval.json')) as f:
    saved = json.load(f)
  assert saved['step'] == 2 and math.isfinite(saved['loss']['test'])
  assert saved['translation']['test']['n'] == 6  # greedy decoding through the recurrent cache
  check_decoder_only_eval(tmp_path, 'test', 6)  # the recurrent cache's decoding: the loop's
  assert any('attention' in name for name in os.listdir(tmp_path)), os.listdir(tmp_path)


def test_a_bad_conv_width_exits_2_with_one_line(data_dir, tmp_path):
  out = subprocess.run(BASE + ['--config.model.deltanet_conv=0', f'--workdir={tmp_path / "w"}',
                               f'--config.data.data_dir={data_dir}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1].endswith(
      'model.deltanet_conv=0 must be a positive integer; valid values: 1, 2, 3, ...'), out.stderr
  assert not (tmp_path / 'w').exists()
