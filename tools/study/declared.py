"""What a study file declares beside its sweep (`STUDY`), read and checked; its baseline cell found.

A study file is a sweep file (configs/ablations/*.py, tools/sweep/__main__.py) with a `STUDY` dict:

    STUDY = {
        'page': 'docs/studies/mqar_attention.md',      # where its results are written up
        'baseline': {'model.attention': 'dense'},      # the cell the others are tested against
        'metrics': ('accuracy.test', 'recall_pairs@16'),  # its headline (tools.compare.stats')
        'forms': {'smoke': ('quick', 'cost on this machine'), 'full': ('', '...')},
    }

`baseline` selects the cell whose overrides hold every field=value it names, the one with the
fewest overrides where several do (dense, not dense with 2 KV heads), or is None for a study
without one (a grid read as curves). A form maps a name to the sweep file's `:ARG` and its cost as
measured ('not measured' where it was not), and may add a baseline of its own where its cells
differ (`'stability': ('stability', cost, {'train.learning_rate': 0.001})`); the first form is
the smoke form. A study's eval.py flags are its sweep's `eval_flags`.
"""

import glob
import os

from tools.sweep import spec as sweep_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ('page', 'baseline', 'metrics', 'forms')


class StudyError(ValueError):
  """A study file or form that cannot run; the message names the problem."""


def study_files():
  """Every sweep file of configs/ablations, sorted."""
  return sorted(glob.glob(os.path.join(ROOT, 'configs', 'ablations', '[!_]*.py')))


def read(module):
  """The module's STUDY, checked (StudyError naming the field)."""
  study = getattr(module, 'STUDY', None)
  name = module.__file__
  if not isinstance(study, dict) or set(study) != set(KEYS):
    raise StudyError(f'{name}: STUDY must be a dict with the keys {", ".join(KEYS)}; got '
                     f'{sorted(study) if isinstance(study, dict) else type(study).__name__}')
  if not os.path.isfile(os.path.join(ROOT, study['page'])):
    raise StudyError(f"{name}: STUDY['page']={study['page']!r} does not exist")
  if study['baseline'] is not None and not isinstance(study['baseline'], dict):
    raise StudyError(f"{name}: STUDY['baseline'] must be a dict of field: value, or None")
  forms = study['forms']
  if not forms or not all(isinstance(v, tuple) and len(v) in (2, 3) for v in forms.values()):
    raise StudyError(f"{name}: STUDY['forms'] must map names to (':ARG', cost[, baseline])")
  return study


def form_arg(study, form):
  """The sweep file's `:ARG` of `form`, a declared form's name or its `:ARG` itself ('quick');
  None for the default form (no FORM). StudyError naming the valid forms otherwise."""
  if form is None:
    return None
  if form in study['forms']:
    return study['forms'][form][0] or None
  if form in {arg for arg, *_ in study['forms'].values() if arg}:
    return form
  valid = [f'{name} ({arg or "the default"})' for name, (arg, *_) in study['forms'].items()]
  raise StudyError(f':{form} is not a form of this study; valid: {", ".join(valid)}')


def baseline_of(study, form):
  """The baseline selector of `form`: its own where it declares one, else the study's."""
  declared_form = study['forms'].get(form, ())
  return declared_form[2] if len(declared_form) == 3 else study['baseline']


def baseline_cell(want, cells):
  """The name, without its seed, of the cell the selector `want` (field: value) picks among
  `cells` (tools.sweep.spec.expand's), or None for no selector (StudyError when no cell, or two
  equally small ones, match)."""
  if want is None:
    return None
  text = {k: sweep_spec.format_value(v) for k, v in want.items()}
  names = {}
  for cell in cells:
    have = {k: sweep_spec.format_value(v) for k, v in cell['overrides'].items()}
    if all(have.get(k) == v for k, v in text.items()):
      names[cell['name'].rsplit(',seed=', 1)[0]] = len(have)
  if not names:
    raise StudyError(f'no cell of this form has the baseline {want}; cells: '
                     f'{sorted({c["name"].rsplit(",seed=", 1)[0] for c in cells})}')
  fewest = min(names.values())
  chosen = [n for n, count in names.items() if count == fewest]
  if len(chosen) > 1:
    raise StudyError(f'the baseline {want} matches {chosen} alike; name one more field')
  return chosen[0]


def listing():
  """`tools.study --list`: every study file with its page, baseline and forms (cost)."""
  lines = []
  for path in study_files():
    module = sweep_spec.load_sweep_module(path)
    study = read(module)
    rel = os.path.relpath(path, ROOT)
    base = ','.join(f'{k}={v}' for k, v in (study['baseline'] or {}).items()) or 'none'
    lines.append(f'{rel}  (page {study["page"]}; baseline {base})')
    for form, (_, cost, *_) in study['forms'].items():
      lines.append(f'  {form:<6} python -m tools.study {rel}:{form} --dir=DIR  ({cost})')
  return '\n'.join(lines)
