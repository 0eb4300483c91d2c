"""model.attention='differential' through the command lines: train.py trains two steps (xla kernel)
and eval.py translates with the KV cache from its checkpoint; odd heads exit 2 with one line.
(The numbers: tests/unit/test_differential.py.)"""

import json
import math
import subprocess
import sys

from tests.helpers import ROOT, metric_rows
from tests.integration.test_eval import check_decoder_only_eval

BASE = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
        '--config.model.attention=differential', '--config.model.position=rope',
        '--config.train.steps=2', '--config.train.warmup_steps=0',
        '--config.train.log_every=1', '--config.train.eval_every=2',
        '--config.train.checkpoint_every=2']


def test_train_py_trains_and_eval_py_decodes_with_the_cache(data_dir, tmp_path):
  out = subprocess.run(BASE + ['--config.model.num_kv_heads=2', f'--workdir={tmp_path}',
                               f'--config.data.data_dir={data_dir}'], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2]
  assert all(math.isfinite(r['loss']) and r['loss'] > 0 for r in rows)
  out = subprocess.run([sys.executable, 'eval.py', f'--workdir={tmp_path}', '--split=test',
                        '--max_examples=4'], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  saved = json.loads((tmp_path / 'eval.json').read_text())
  assert saved['step'] == 2 and saved['translation']['test']['n'] == 4
  check_decoder_only_eval(tmp_path, 'test', 4)  # the cache's decoding is the argmax loop's


def test_odd_key_value_heads_exit_2_with_one_line(data_dir, tmp_path):
  out = subprocess.run(BASE + ['--config.model.num_kv_heads=1', f'--workdir={tmp_path / "w"}',
                               f'--config.data.data_dir={data_dir}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1].endswith(
      "model.num_kv_heads=1 must be even for model.attention='differential' (each differential "
      'head is a pair of softmax maps); valid values: 2, 4, 6, ...'), out.stderr[-3000:]
  assert not (tmp_path / 'w').exists()
