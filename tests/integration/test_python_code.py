"""data.task=python_code through the command lines: configs/python_code.py:quick trains on the
local stdlib's files (60 a split), records the interpreter and the files' hash, and eval.py
reports the loss by position at 1, 2 and 4 x L; a train.py resumed against another corpus of
files is refused in one line."""

import json
import os
import platform

from tests.helpers import ROOT, metric_rows
from tests.integration.test_text_data import EVAL, TRAIN, cli


def test_python_code_quick_trains_and_reports_the_loss_by_position(tmp_path):
  workdir, data_dir = tmp_path / 'run', tmp_path / 'data'
  args = [TRAIN, f'--config={ROOT}/configs/python_code.py:quick', f'--workdir={workdir}',
          f'--config.data.data_dir={data_dir}', '--config.train.steps=30',
          '--config.train.learning_rate=3e-3', '--config.train.log_every=10']
  out = cli(*args)
  assert out.returncode == 0, out.stderr[-3000:]
  losses = [row['loss'] for row in metric_rows(str(workdir))]
  assert losses[-1] < losses[0] - 0.5, losses  # from ~6.2 (500 pieces) down
  with open(workdir / 'run_info.json') as f:
    info = json.load(f)
  record = info['python_code']
  assert record['python'] == platform.python_version() and len(record['files_hash']) == 16
  assert record['files']['train'] == 60 and info['corpus']['files']['train'].endswith(
      os.path.join(f'py{record["python"]}-{record["files_hash"]}', 'train.txt'))
  out = cli(EVAL, f'--workdir={workdir}', '--split=test', '--lengths=1,2,4',
            '--modes=non_overlapping')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(workdir / 'eval.json') as f:
    result = json.load(f)
  assert sorted(int(n) for n in result['extrapolation_per_position']) == [64, 128, 256]
  assert len(result['extrapolation_per_position']['256']) == 256
  # The same workdir with other files (another data.code_max_files): refused, files named.
  out = cli(*args, '--config.data.code_max_files=59', '--config.train.steps=40')
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
  assert "data.task='python_code': this run trained on the stdlib of Python" in out.stderr
  assert f'(files hash {record["files_hash"]})' in out.stderr and 'code_max_files' in out.stderr
