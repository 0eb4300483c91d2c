"""model.final_logit_softcap and train.z_loss through train.py: two steps train with each (the plain
loss path and the tiled one), the z-loss's mean (log Z)² is a column of the train rows exactly when
it is on, and a bad value exits 2 with one line. (The numbers: tests/unit/test_softcap.py,
test_z_loss.py, test_losses.py.)"""

import math
import subprocess
import sys

import pytest

from tests.helpers import ROOT, metric_rows

BASE = [sys.executable, 'train.py', '--config=configs/decoder_only.py:quick',
        '--config.train.steps=2', '--config.train.warmup_steps=0', '--config.train.log_every=1',
        '--config.train.eval_every=2', '--config.train.checkpoint_every=2']


@pytest.mark.parametrize('flags,z_loss', [
    (['--config.model.final_logit_softcap=30', '--config.train.z_loss=1e-4'], True),
    (['--config.model.final_logit_softcap=30', '--config.train.z_loss=1e-4',
      '--config.train.loss_chunk=32'], True),
    (['--config.model.final_logit_softcap=30', '--config.train.loss_chunk=32'], False),
], ids=['plain', 'tiled', 'tiled-softcap-only'])
def test_train_py_trains_two_steps_with_them(data_dir, tmp_path, flags, z_loss):
  out = subprocess.run(
      BASE + flags + [f'--workdir={tmp_path}', f'--config.data.data_dir={data_dir}'], cwd=ROOT,
      capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2]
  for row in rows:
    assert math.isfinite(row['loss']) and row['loss'] > 0
    assert ('z_loss' in row) == z_loss, row
    if z_loss:  # untrained logits near 0: (log Z)² near (log V)², V = 166
      assert 0.5 * math.log(166) ** 2 < row['z_loss'] < 2 * math.log(166) ** 2, row
  assert math.isfinite(metric_rows(tmp_path, 'valid')[0]['loss'])


def test_a_negative_z_loss_exits_2_with_one_line(data_dir, tmp_path):
  out = subprocess.run(BASE + ['--config.train.z_loss=-1', f'--workdir={tmp_path / "w"}',
                               f'--config.data.data_dir={data_dir}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  assert out.stderr.strip().splitlines()[-1].endswith(
      'train.z_loss=-1.0 must be a finite number >= 0 (0 = off)'), out.stderr
  assert not (tmp_path / 'w').exists()
