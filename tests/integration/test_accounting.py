"""models.accounting and the tools.accounting CLI: the textbook numbers (ARCHITECTURE.md, "Facts the
tests check"), counts equal to the real model, FLOPs equal to XLA's."""

import os
import re
import subprocess
import sys

import pytest

from configs import decoder_only
from training import validation
from models import accounting
from tests.helpers import ROOT, tiny
from tools import accounting as accounting_cli

V = 166  # the toy task's vocabulary


def run_cli(*args):
  return subprocess.run([sys.executable, '-m', 'tools.accounting', *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})


def test_cli_prints_the_table_for_decoder_only():
  proc = run_cli('--config=configs/decoder_only.py')
  assert proc.returncode == 0, proc.stderr
  config = validation.resolve(decoder_only.get_config())
  total = sum(accounting.formula_params(config.model, V, config.data.max_length).values())
  out = proc.stdout
  assert '| **total** | ' in out and f'**{total:,}**' in out
  assert '| attention | 65,536 | 3 | 196,608 | 4·D² |' in out
  assert '268,435,456' in out and '512.00 MiB' in out  # the textbook cache example (fp16)
  # Any document the table cites is in the repository.
  assert all(os.path.exists(os.path.join(ROOT, n)) for n in re.findall(r'\b\w+\.md\b', out))


def test_a_non_transformer_is_refused():
  config = tiny(arch='rnn_seq2seq')
  with pytest.raises(ValueError, match='Transformer archs'):
    accounting_cli.report(config, V)
  proc = run_cli('--config=configs/rnn_seq2seq.py')
  assert proc.returncode == 2 and proc.stdout == ''
  assert proc.stderr.strip().splitlines()[-1] == (
      "config error: model.arch='rnn_seq2seq': accounting covers the Transformer archs; valid "
      'values: decoder_only, encoder_only, encoder_decoder')
