"""model.layer_pattern through the command lines: train.py trains a hybrid stack (linear and dense
layers) two steps, eval.py translates with each layer's own cache, and an entry with no causal
form exits 2 with one line. (The numbers: tests/unit/test_layer_pattern.py.)"""

import json
import math
import os
import subprocess
import sys

from tests.helpers import ROOT, metric_rows
from tests.integration.test_eval import check_decoder_only_eval

TRAIN = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
         '--config.train.steps=2', '--config.train.warmup_steps=0', '--config.train.log_every=1',
         '--config.train.eval_every=2', '--config.train.checkpoint_every=2',
         '--config.model.num_layers=3']


def test_train_py_and_eval_py_run_a_hybrid_stack(data_dir, tmp_path):
  out = subprocess.run(
      TRAIN + ['--config.model.layer_pattern=linear,dense', f'--workdir={tmp_path}',
               f'--config.data.data_dir={data_dir}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert [r['step'] for r in metric_rows(tmp_path)] == [1, 2]
  assert all(math.isfinite(r['loss']) and r['loss'] > 0 for r in metric_rows(tmp_path))
  with open(os.path.join(tmp_path, 'config.json')) as f:
    assert json.load(f)['model']['layer_pattern'] == 'linear,dense'
  out = subprocess.run([sys.executable, 'eval.py', f'--workdir={tmp_path}', '--split=test',
                        '--max_examples=6'], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(tmp_path, 'eval.json')) as f:
    saved = json.load(f)
  assert saved['step'] == 2 and math.isfinite(saved['loss']['test'])
  assert saved['translation']['test']['n'] == 6  # decoded with the cache, token by token
  check_decoder_only_eval(tmp_path, 'test', 6)  # each layer's cache decodes as the loop


def test_an_entry_with_no_causal_form_exits_2_with_one_line(data_dir, tmp_path):
  out = subprocess.run(
      TRAIN + ['--config.model.layer_pattern=linear,linformer', f'--workdir={tmp_path}',
               f'--config.data.data_dir={data_dir}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 2, out.stderr[-3000:]
  lines = [line for line in out.stderr.splitlines() if 'layer_pattern' in line]
  assert len(lines) == 1 and "entry 'linformer'" in lines[0] and 'not causal' in lines[0], (
      out.stderr[-2000:])
