"""The stdlib code corpus (data/python_code.py): which files, which split, the one-line encoding
that keeps newlines and indentation through SentencePiece, the record a run keeps, and the config
checks."""

import json
import os

import pytest

from configs import python_code as python_code_config
from data import pipeline
from data import python_code
from layers import options
from training import validation


def _tree(root):
  """A fake stdlib: two modules, a package, and folders that must be left out."""
  files = {'a.py': 'def f(x):\n\tif x:\n        return 1\n', 'pkg/__init__.py': 'X = 1\n',
           'pkg/b.py': 'class B:\n    pass\n', 'test/test_a.py': 'assert 0\n',
           'pkg/tests/t.py': 'assert 0\n', 'idlelib/idle_test/t.py': 'assert 0\n',
           'site-packages/jax/x.py': 'import jax\n', 'notes.txt': 'not code\n'}
  for name, text in files.items():
    os.makedirs(os.path.dirname(os.path.join(root, name)) or root, exist_ok=True)
    with open(os.path.join(root, name), 'w') as f:
      f.write(text)


def test_the_files_leave_tests_and_site_packages_out(tmp_path):
  _tree(tmp_path)
  assert python_code.stdlib_files(str(tmp_path)) == ('a.py', 'pkg/__init__.py', 'pkg/b.py')


def test_the_split_follows_the_path_alone():
  names = [f'm{i}/mod{i}.py' for i in range(2000)]
  splits = [python_code.split_of(n) for n in names]
  assert splits == [python_code.split_of(n) for n in names]  # stable
  shares = {s: splits.count(s) / len(names) for s in python_code.SHARES}
  assert abs(shares['train'] - 0.9) < 0.03 and abs(shares['test'] - 0.05) < 0.02


def test_a_file_is_one_line_that_keeps_newlines_and_indentation():
  text = 'def f(x):\n\tif x:\n        return  x\n\n'
  line = python_code.encode_document(text)
  assert '\n' not in line  # inner runs of spaces stay here; SentencePiece folds them
  assert line == 'def f(x):␊····if x:␊········return  x'
  assert python_code.decode_document(line) == 'def f(x):\n    if x:\n        return  x'


def test_prepared_files_and_their_record(tmp_path):
  root, data_dir = tmp_path / 'lib', tmp_path / 'data'
  _tree(root)
  corpus = python_code.prepare_files(str(data_dir), 0, str(root))
  counts = dict(corpus.counts)
  assert sum(counts.values()) == 3
  lines = sum(len(open(os.path.join(corpus.folder, f'{s}.txt')).read().splitlines())
              for s in counts if counts[s])
  assert lines == 3  # one document a line
  with open(os.path.join(corpus.folder, python_code.MANIFEST)) as f:
    manifest = json.load(f)
  assert manifest['files_hash'] == corpus.files_hash and manifest['files'] == counts
  assert corpus.record()['python'] == manifest['python']
  # Another file changes the hash, so a run compares only against data of the same files.
  with open(root / 'c.py', 'w') as f:
    f.write('Y = 2\n')
  python_code.stdlib_files.cache_clear()  # one process reads the files once
  python_code.prepare_files.cache_clear()
  assert python_code.prepare_files(str(data_dir), 0, str(root)).files_hash != corpus.files_hash


def test_the_config_files_validate_and_bad_fields_are_one_line():
  for arg in (None, 'quick'):
    config = validation.resolve(python_code_config.get_config(arg))
    validation.validate(config)
    assert not pipeline.has_pairs(config.data)
  config = validation.resolve(python_code_config.get_config('quick'))
  config.data.code_max_files = -1
  with pytest.raises(options.ConfigError, match=r'data.code_max_files=-1 must be an integer '
                     r'>= 0') as e:
    validation.validate(config)
  assert '\n' not in str(e.value)
  config = validation.resolve(python_code_config.get_config('quick'))
  config.model.arch, config.data.packing = 'encoder_decoder', 'none'
  with pytest.raises(options.ConfigError, match="data.task='python_code' .* is not valid for "
                     "model.arch='encoder_decoder'"):
    validation.validate(config)
  config = validation.resolve(python_code_config.get_config('quick'))
  config.data.task = 'base'
  config.data.packing = 'none'
  config.train.loss_on = 'target'
  with pytest.raises(options.ConfigError, match="data.code_max_files=60 is read only by "
                     "data.task='python_code'"):
    validation.validate(config)
