"""model.attn_logit_softcap and model.attention_sinks through train.py: two steps train with both on
under each kernel that takes them (xla, blockwise, ring on a 2-device sequence mesh, pallas
interpreted on this CPU host), to the same losses, and cudnn is refused with one line, exit 2. (The
numbers: tests/unit/test_softcap_sinks.py.)"""

import math
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, metric_rows

BASE = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
        '--config.train.steps=2', '--config.train.warmup_steps=0', '--config.train.log_every=1',
        '--config.train.eval_every=2', '--config.train.checkpoint_every=2',
        '--config.model.attn_logit_softcap=5', '--config.model.attention_sinks=True']
# Two CPU devices: the ring's sequence axis; the other kernels' default mesh splits the batch.
ENV = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=2',
       'JAX_PLATFORMS': 'cpu'}
KERNELS = {'xla': [], 'blockwise': [], 'ring': ['--config.mesh.sequence=2'], 'pallas': []}


def _train(impl, data_dir, workdir, timeout=600):
  return subprocess.run(
      BASE + KERNELS.get(impl, []) + [f'--config.model.attention_impl={impl}',
                                      f'--workdir={workdir}', f'--config.data.data_dir={data_dir}'],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_train_py_trains_two_steps_with_both_under_every_kernel(data_dir, tmp_path):
  losses = {}
  for impl in KERNELS:
    out = _train(impl, data_dir, tmp_path / impl)
    assert out.returncode == 0, (impl, out.stderr[-3000:])
    rows = metric_rows(tmp_path / impl)
    assert [r['step'] for r in rows] == [1, 2], impl
    assert all(math.isfinite(r['loss']) and r['loss'] > 0 for r in rows), (impl, rows)
    assert math.isfinite(metric_rows(tmp_path / impl, 'valid')[0]['loss']), impl
    losses[impl] = [r['loss'] for r in rows]
  # Same initialisation and batches: every kernel gives xla's losses to float32 rounding.
  for impl, got in losses.items():
    assert got == pytest.approx(losses['xla'], rel=1e-4), losses


def test_cudnn_exits_2_with_one_line(data_dir, tmp_path):
  out = _train('cudnn', data_dir, tmp_path / 'w', timeout=120)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1].endswith(
      "model.attn_logit_softcap=5.0 is not taken by model.attention_impl='cudnn'; valid kernels: "
      'blockwise, pallas, ring, splash, xla'), out.stderr
  assert not (tmp_path / 'w').exists()
