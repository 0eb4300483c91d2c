"""Inputs once accepted silently, or answered with a traceback or an unclear line: each is now one
line naming the field (the command lines themselves: tests/integration/test_cli_reliability.py)."""

import json

import pytest

from configs import default
from data import text_corpus
from layers import options
from tools.compare import curves as curves_lib
from tools.compare import runs as runs_lib
from tools.compare import summary as summary_lib
from tools.sweep import spec as sweep_spec
from training import validation


def _config(**fields):
  config = validation.resolve(default.get_config('quick'))
  for field, value in fields.items():
    section, *rest = field.split('.')
    node = config[section]
    for name in rest[:-1]:
      node = node[name]
    node[rest[-1]] = value
  return config


@pytest.mark.parametrize('fields,message', [
    ({'data.files.train': '/tmp/pairs.tsv'},
     "data.files.train='/tmp/pairs.tsv' is read only by data.task='text_pairs' or 'text_lm'"),
    ({'model.rope_scaling': 'pi', 'model.position': 'sinusoidal'},
     "model.rope_scaling='pi' scales RoPE, which model.position='sinusoidal' does not use"),
    ({'train.seed': -1}, r'train.seed=-1 must be an integer in \[0, 2\*\*32\)'),
    ({'train.seed': 2 ** 70}, r'train.seed=1180591620717411303424 must be an integer in'),
])
def test_a_field_no_part_of_the_run_would_read_is_refused(fields, message):
  with pytest.raises(options.ConfigError, match=message) as e:
    validation.validate(_config(**fields))
  assert '\n' not in str(e.value)


def test_rope_scaling_with_rope_is_accepted():
  validation.validate(_config(**{'model.rope_scaling': 'pi', 'model.position': 'rope'}))


def test_a_byte_order_mark_is_not_part_of_the_first_pair(tmp_path):
  path = tmp_path / 'pairs.tsv'
  path.write_bytes('\ufeffhello\tworld\r\nfoo\tbar\r\n'.encode())
  assert text_corpus.read_pairs(str(path), 'data.files.train') == [('hello', 'world'),
                                                                   ('foo', 'bar')]


def test_cr_only_line_endings_are_named(tmp_path):
  path = tmp_path / 'pairs.tsv'
  path.write_bytes(b'hello\tworld\rfoo\tbar\rbaz\tqux\r')
  with pytest.raises(text_corpus.DataError, match='ends its lines with CR alone'):
    text_corpus.read_pairs(str(path), 'data.files.train')


@pytest.mark.parametrize('sweep_dict,message', [
    ({'cells': ['model.norm=rmsnorm']}, "'cells' must be a list of dicts"),
    ({'eval_variants': {'model.position': ['--lengths=2']}},
     "eval_variants selector 'model.position' must be 'field=value"),
])
def test_sweep_shapes_that_matched_nothing_are_refused(sweep_dict, message):
  with pytest.raises(sweep_spec.SweepError, match=message):
    sweep_spec.expand(sweep_dict)


def test_compare_names_its_bad_flags_and_files(tmp_path):
  with pytest.raises(ValueError, match='--target_loss=nan must be a finite loss'):
    summary_lib.summarize([], target_loss=float('nan'))
  with pytest.raises(ValueError, match="--smooth='bogus' is not valid; valid: ema:B"):
    curves_lib.smooth([1.0, 2.0], 'bogus')
  run = tmp_path / 'run'
  run.mkdir()
  (run / 'metrics.jsonl').write_text(json.dumps({'step': 1, 'split': 'train', 'loss': 1.0}) + '\n')
  (run / 'config.json').write_text('{"model": ')
  with pytest.raises(ValueError, match=r'config.json is not valid JSON'):
    runs_lib.load_run(str(run))
