"""training.writers: metrics.jsonl stays strict JSON, survives a torn last line, names a bad one,
and a resume's rewrite is atomic."""

import json
import math
import os

import pytest

from training import writers


def write(path, text):
  with open(path, 'w') as f:
    f.write(text)


def test_non_finite_values_are_strict_json_and_read_back(tmp_path):
  line = writers.encode_row({'step': 3, 'split': 'train', 'loss': float('nan'),
                             'grad_norm': float('inf'), 'accuracy': 0.5})
  row = json.loads(line)  # strict: no NaN/Infinity tokens
  assert row['loss'] is None and row['nonfinite'] == {'loss': 'nan', 'grad_norm': 'inf'}
  write(tmp_path / 'm.jsonl', line)
  back = writers.read_metrics(str(tmp_path / 'm.jsonl'))[0]
  assert math.isnan(back['loss']) and back['grad_norm'] == math.inf and back['accuracy'] == 0.5
  assert 'nonfinite' not in back


def test_a_torn_last_line_is_skipped_with_one_warning(tmp_path, capsys):
  write(tmp_path / 'm.jsonl', writers.encode_row({'step': 1, 'split': 'train', 'loss': 2.0}) +
        '{"step": 2, "split": "tr')
  assert [r['step'] for r in writers.read_metrics(str(tmp_path / 'm.jsonl'))] == [1]
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and 'torn last line 2' in err


def test_a_bad_line_elsewhere_is_named(tmp_path):
  write(tmp_path / 'm.jsonl', '{"step": 1, "split": "train", "loss": 2.0}\ngarbage\n'
        '{"step": 2, "split": "train", "loss": 1.0}\n')
  with pytest.raises(ValueError, match='line 2 is not a metrics row'):
    writers.read_metrics(str(tmp_path / 'm.jsonl'))


def test_resume_keeps_rows_up_to_the_step_through_a_renamed_file(tmp_path, monkeypatch):
  path = tmp_path / 'metrics.jsonl'
  write(path, ''.join(writers.encode_row({'step': s, 'split': 'train', 'loss': float(s)})
                      for s in range(1, 6)) + '{"step": 6, "sp')
  replaced = []
  real = os.replace
  monkeypatch.setattr(writers.os, 'replace', lambda a, b: (replaced.append((a, b)), real(a, b)))
  writer = writers.MetricsWriter(str(tmp_path), 3)
  writer.write(4, 'train', {'loss': 0.5})
  writer.close()
  assert replaced == [(str(path) + '.tmp', str(path))]
  assert [(r['step'], r['loss']) for r in writers.read_metrics(str(path))] == [
      (1, 1.0), (2, 2.0), (3, 3.0), (4, 0.5)]
