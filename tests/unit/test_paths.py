"""training.paths: one set of helpers for local paths and gs:// URLs (the gs:// side runs against
an emulator in tests/integration/test_gcs.py)."""

import os

import pytest

from training import paths


@pytest.mark.parametrize('path,remote', [('gs://b/run', True), ('/tmp/run', False),
                                         ('run', False), ('s3://b/x', True)])
def test_is_remote(path, remote):
  assert paths.is_remote(path) is remote


def test_urls_stay_urls():
  assert paths.join('gs://b/run', 'checkpoints', '3') == 'gs://b/run/checkpoints/3'
  assert paths.dirname('gs://b/run/metrics.jsonl') == 'gs://b/run'
  assert paths.basename('gs://b/sweep/cell,seed=0/') == 'cell,seed=0'
  assert paths.absolute('gs://b/run/') == 'gs://b/run'


def test_local_paths_are_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert paths.absolute('run') == str(tmp_path / 'run')
  assert paths.join('run', 'x') == os.path.join('run', 'x')


def test_local_writes_are_atomic_and_listings_sorted(tmp_path):
  target = str(tmp_path / 'd' / 'a.json')
  paths.makedirs(paths.dirname(target))
  paths.write_json(target, {'x': 1})
  assert paths.read_json(target) == {'x': 1}
  assert sorted(os.listdir(tmp_path / 'd')) == ['a.json']  # no temporary file left
  paths.write_bytes(str(tmp_path / 'd' / 'b'), b'\x00')
  paths.replace(str(tmp_path / 'd' / 'b'), str(tmp_path / 'd' / 'c'))
  assert paths.listdir(str(tmp_path / 'd')) == ['a.json', 'c']
  assert paths.listdir(str(tmp_path / 'missing')) == []
  paths.remove(str(tmp_path / 'd'))
  assert not paths.exists(str(tmp_path / 'd'))
