"""tools.study: every study file declares its page, baseline, headline metrics and forms; the
baseline selects one cell in every form; --list names every file; a bad declaration or form is one
line before anything runs."""

import os
import types

import pytest

from tools.study import __main__ as study_cli
from tools.study import declared
from tools.sweep import spec as sweep_spec


@pytest.mark.parametrize('path', declared.study_files(), ids=os.path.basename)
def test_every_study_file_declares_a_baseline_that_selects_one_cell_in_every_form(path):
  module = sweep_spec.load_sweep_module(path)
  study = declared.read(module)
  assert list(study['forms'])[0] == 'smoke' and study['metrics']
  for form in study['forms']:
    cells = sweep_spec.expand(sweep_spec.get_sweep(module, declared.form_arg(study, form)))
    want = declared.baseline_of(study, form)
    cell = declared.baseline_cell(want, cells)
    if want is None:
      assert cell is None
    else:  # the cell's overrides hold the selector's fields
      assert all(f'{k}={sweep_spec.format_value(v)}' in cell.split(',')
                 for k, v in want.items()), (form, cell)


def test_the_baseline_is_the_smallest_matching_cell_and_a_tie_is_refused():
  study = {'model.attention': 'dense'}
  cells = sweep_spec.expand({'cells': [{'model.attention': 'dense', 'model.num_kv_heads': 2},
                                       {'model.attention': 'dense'},
                                       {'model.attention': 'linear'}]}, seeds=[0, 1])
  assert declared.baseline_cell(study, cells) == 'model.attention=dense'
  tie = sweep_spec.expand({'cells': [{'model.attention': 'dense', 'model.num_kv_heads': 2},
                                     {'model.attention': 'dense', 'model.num_kv_heads': 1}]})
  with pytest.raises(declared.StudyError, match='matches .* alike; name one more field'):
    declared.baseline_cell(study, tie)
  with pytest.raises(declared.StudyError, match='no cell of this form has the baseline'):
    declared.baseline_cell({'model.attention': 'mla'}, cells)


def test_list_names_every_study_file_and_its_forms():
  text = declared.listing()
  for path in declared.study_files():
    rel = os.path.relpath(path, declared.ROOT)
    assert f'{rel}  (page ' in text
    assert f'python -m tools.study {rel}:smoke --dir=DIR' in text


def test_a_bad_declaration_is_one_line():
  module = types.SimpleNamespace(__file__='x.py', STUDY={'page': 'docs/sweeps.md'})
  with pytest.raises(declared.StudyError, match='STUDY must be a dict with the keys page, '):
    declared.read(module)
  module.STUDY = {'page': 'docs/nothing.txt', 'baseline': None, 'metrics': (), 'forms': {}}
  with pytest.raises(declared.StudyError, match="STUDY\\['page'\\]='docs/nothing.txt' does not"):
    declared.read(module)


def test_a_form_is_a_declared_name_or_its_argument_and_nothing_else():
  study = {'forms': {'smoke': ('quick', 'c'), 'full': ('', 'c'), 'code': ('code', 'c')}}
  assert declared.form_arg(study, 'smoke') == declared.form_arg(study, 'quick') == 'quick'
  assert declared.form_arg(study, 'full') is None and declared.form_arg(study, None) is None
  with pytest.raises(declared.StudyError, match=r':nonsense is not a form of this study; valid: '
                     r'smoke \(quick\), full \(the default\), code \(code\)'):
    declared.form_arg(study, 'nonsense')


def test_the_headline_table_holds_the_declared_metrics_only():
  stats = {'attention=dense': {'accuracy.test': {'mean': 0.9, 'ci95': [0.8, 1.0],
                                                 'verdict': 'baseline', 'p_holm': None},
                               'final_valid': {'mean': 2.0, 'ci95': [1.9, 2.1]}},
           'attention=linear': {'accuracy.test': {'mean': 0.3, 'ci95': [0.2, 0.4],
                                                  'verdict': 'worse', 'p_holm': 0.0312}}}
  table = study_cli.headline(stats, ('accuracy.test',)).splitlines()
  assert table[2:] == ['| accuracy.test | attention=dense | 0.9 [0.8, 1] | baseline | - |',
                       '| accuracy.test | attention=linear | 0.3 [0.2, 0.4] | worse | 0.0312 |']
