"""data.tokenizer (a Hugging Face tokenizer.json) through train.py and eval.py: text_lm trains two
steps and is evaluated, passkey in your own text trains two steps and reports its retrieval grid,
and a task that does not take a tokenizer exits 2 with one line. The tokenizer is the small BPE of
tests/unit/test_hf_tokenizer.py (V about 360, its bos and eos the last two ids)."""

import json
import math
import subprocess
import sys

import pytest

from data import hf_tokenizer
from tests.helpers import ROOT, metric_rows
from tests.unit.test_hf_tokenizer import write_tokenizer

STEPS = ['--config.train.steps=2', '--config.train.warmup_steps=0', '--config.train.log_every=1',
         '--config.train.eval_every=2', '--config.train.checkpoint_every=2']


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  return write_tokenizer(tmp_path_factory.mktemp('hf'))


def _run(script, *args):
  return subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)


def _data_flags(hf_dir, tmp_path):
  return [f'--config.data.tokenizer={hf_dir}', f'--config.data.data_dir={tmp_path / "data"}',
          f'--config.data.files.train={hf_dir}/train.txt']


def test_text_lm_trains_and_evaluates_with_it(hf_dir, tmp_path):
  workdir = tmp_path / 'run'
  out = _run('train.py', '--config=configs/text_lm.py:quick', f'--workdir={workdir}',
             '--config.data.max_length=32', *STEPS, *_data_flags(hf_dir, tmp_path),
             f'--config.data.files.validation={hf_dir}/validation.txt',
             f'--config.data.files.test={hf_dir}/test.txt')
  assert out.returncode == 0, out.stderr[-3000:]
  rows = metric_rows(workdir)
  assert [r['step'] for r in rows] == [1, 2]
  log_v = math.log(hf_tokenizer.HFTokenizer.load(hf_dir).vocab_size)
  for row in rows:  # untrained: near log V of the tokenizer's ids
    assert 0.5 * log_v < row['loss'] < 2 * log_v, row
  with open(workdir / 'run_info.json') as f:
    assert json.load(f)['corpus']['folder'].startswith('text_lm/hf-')
  out = _run('eval.py', f'--workdir={workdir}')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(workdir / 'eval.json') as f:
    result = json.load(f)
  assert all(math.isfinite(result['loss'][s]) for s in ('validation', 'test')), result


def test_passkey_in_your_text_trains_and_reports_retrieval(hf_dir, tmp_path):
  workdir = tmp_path / 'run'
  out = _run('train.py', '--config=configs/passkey.py:quick', f'--workdir={workdir}',
             '--config.data.max_length=48', *STEPS, *_data_flags(hf_dir, tmp_path))
  assert out.returncode == 0, out.stderr[-3000:]
  assert [r['step'] for r in metric_rows(workdir)] == [1, 2]
  out = _run('eval.py', f'--workdir={workdir}', '--retrieval_examples=2', '--split=validation')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(workdir / 'eval.json') as f:
    result = json.load(f)
  assert list(result['retrieval']) == ['48', '96', '192', '384']  # 1, 2, 4, 8 x L
  for row in result['retrieval'].values():
    assert len(row) == 11 and all(a in (0.0, 0.5, 1.0) for a in row.values())
  assert math.isfinite(result['loss']['validation'])


def test_a_task_without_it_exits_2_with_one_line(hf_dir, tmp_path):
  out = _run('train.py', '--config=configs/decoder_only.py:quick', f'--workdir={tmp_path / "w"}',
             f'--config.data.tokenizer={hf_dir}', f'--config.data.data_dir={tmp_path / "d"}')
  assert out.returncode == 2 and out.stderr.count('\n') == 1, out.stderr[-2000:]
  assert (f"config error: data.tokenizer='{hf_dir}' is read only by data.task text_lm, "
          'python_code, passkey') in out.stderr
  assert not (tmp_path / 'w').exists() and not (tmp_path / 'd').exists()
