"""model.attention='mla' through the command lines: train.py trains two steps of a decoder (xla,
RoPE's decoupled key, a query latent) with the diagnostics' score statistics, run_info.json records
the latent cache per token, and eval.py translates with the latent KV cache. (The numbers:
tests/unit/test_mla.py.)"""

import json
import math
import os
import subprocess
import sys

from tests.helpers import ROOT, metric_rows
from tests.integration.test_eval import check_decoder_only_eval

MLA = ['--config.model.attention=mla', '--config.model.position=rope',
       '--config.model.attention_impl=xla', '--config.model.mla_kv_rank=16',
       '--config.model.mla_q_rank=24']


def test_train_py_then_eval_py_decode_an_mla_decoder(data_dir, tmp_path):
  workdir = tmp_path / 'run'
  out = subprocess.run(
      [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
       '--config.train.steps=2', '--config.train.warmup_steps=0', '--config.train.log_every=1',
       '--config.train.eval_every=2', '--config.train.checkpoint_every=2',
       '--config.train.diagnostics=True', f'--workdir={workdir}',
       f'--config.data.data_dir={data_dir}'] + MLA,
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = metric_rows(workdir)
  assert [r['step'] for r in rows] == [1, 2]
  assert all(math.isfinite(r['loss']) and r['loss'] > 0 for r in rows)
  # has_scores: the diagnostics read the softmax statistics of the layer's own q·k
  logits = [v for k, v in rows[0].items() if k.startswith('attn_max_logit/')]
  assert logits and all(math.isfinite(v) for v in logits), rows[0]
  with open(workdir / 'config.json') as f:
    model = json.load(f)['model']
  with open(workdir / 'run_info.json') as f:
    info = json.load(f)
  # H = 64 / 4 = 16, so d_h^R = 8: (d_c + d_h^R) per layer.
  assert info['kv_cache_per_token'] == model['num_layers'] * (16 + 8), info
  out = subprocess.run(
      [sys.executable, 'eval.py', f'--workdir={workdir}', '--split=test', '--max_examples=8'],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(workdir, 'eval.json')) as f:
    saved = json.load(f)
  assert saved['translation']['test']['n'] == 8
  assert math.isfinite(saved['loss']['test'])
  check_decoder_only_eval(workdir, 'test', 8)  # the latent cache's decoding: the loop's
