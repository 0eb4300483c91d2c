"""The package layering, read from every module's imports with `ast`: who may import whom.

    configs/   ml_collections and configs only (a sweep names its variants as strings)
    data/      data only
    layers/    layers only
    models/    layers and models
    training/  configs, data, layers, models, training (the library; never tools/)
    tools/     anything but train.py and eval.py (they launch those as processes)
    train.py, eval.py   flags and main; nothing imports either, and neither imports the other

and the rules that keep the code honest: no importlib in layers/ or models/, no assignment to a
`__call__` (no patching of a model while it is traced), no library file over 500 lines, train.py
at most 200 lines and eval.py at most 300.
"""

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ('configs', 'data', 'layers', 'models', 'training', 'tools', 'benchmarks', 'tests')
SCRIPTS = ('train', 'eval')
PROJECT = PACKAGES + SCRIPTS
ALLOWED = {
    'configs': {'configs'},
    'data': {'data'},
    'layers': {'layers'},
    'models': {'layers', 'models'},
    'training': {'configs', 'data', 'layers', 'models', 'training'},
    'tools': {'configs', 'data', 'layers', 'models', 'training', 'tools'},
    'benchmarks': {'configs', 'data', 'layers', 'models', 'training', 'tools', 'benchmarks'},
    'tests': {'configs', 'data', 'layers', 'models', 'training', 'tools', 'tests'},
    'train': {'configs', 'data', 'layers', 'models', 'training', 'tools'},
    'eval': {'configs', 'data', 'layers', 'models', 'training', 'tools'},
}
# configs/ is data: besides the standard library, only ml_collections.
CONFIGS_THIRD_PARTY = {'ml_collections'}


def python_files():
  """(owner, path) of every project module: owner is its top-level package or script name."""
  for name in SCRIPTS:
    yield name, os.path.join(ROOT, f'{name}.py')
  for package in PACKAGES:
    for directory, dirs, files in os.walk(os.path.join(ROOT, package)):
      dirs[:] = [d for d in dirs if d not in ('__pycache__', 'fixtures')]
      for f in sorted(files):
        if f.endswith('.py'):
          yield package, os.path.join(directory, f)


FILES = sorted(python_files())


def imported_modules(tree):
  """The top-level names of every module a file imports (at any depth of the file)."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(a.name.split('.')[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module.split('.')[0])
  return names


def rel(path):
  return os.path.relpath(path, ROOT)


@pytest.mark.parametrize('owner,path', FILES, ids=[rel(p) for _, p in FILES])
def test_imports_follow_the_layering(owner, path):
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  imports = imported_modules(tree)
  project = imports & set(PROJECT)
  bad = sorted(project - ALLOWED[owner])
  assert not bad, f'{rel(path)} imports {bad}; {owner} may import only {sorted(ALLOWED[owner])}'
  if owner == 'configs':
    third_party = imports - set(PROJECT) - set(sys.stdlib_module_names)
    assert third_party <= CONFIGS_THIRD_PARTY, f'{rel(path)} imports {sorted(third_party)}'
  if owner in ('layers', 'models'):
    assert 'importlib' not in imports, f'{rel(path)} uses importlib: register with plain imports'


@pytest.mark.parametrize('owner,path', FILES, ids=[rel(p) for _, p in FILES])
def test_nothing_assigns_to_a_call_method(owner, path):
  del owner
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    for target in targets:
      assert not (isinstance(target, ast.Attribute) and target.attr == '__call__'), (
          f'{rel(path)}:{node.lineno} assigns to __call__')
    if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'setattr':
      args = node.args
      assert not (len(args) > 1 and isinstance(args[1], ast.Constant)
                  and args[1].value == '__call__'), f'{rel(path)}:{node.lineno} sets __call__'


def test_file_sizes():
  lines = {rel(p): sum(1 for _ in open(p)) for _, p in FILES}
  assert lines['train.py'] <= 200, lines['train.py']
  assert lines['eval.py'] <= 300, lines['eval.py']
  library = {p: n for p, n in lines.items()
             if p.split(os.sep)[0] in ('configs', 'data', 'layers', 'models', 'training', 'tools')}
  assert all(n <= 500 for n in library.values()), {p: n for p, n in library.items() if n > 500}


def test_no_citation_of_a_file_the_repository_lacks():
  """Every markdown file a source or doc file cites by name exists in the repository."""
  import re  # pylint: disable=g-import-not-at-top
  docs = [os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith('.md')]
  docs += [os.path.join(ROOT, 'benchmarks', 'README.md')]
  missing = []
  for path in [p for _, p in FILES] + docs:
    with open(path) as f:
      for name in set(re.findall(r'\b([A-Za-z_]+\.md)\b', f.read())):
        here = [os.path.join(os.path.dirname(path), name), os.path.join(ROOT, name)]
        if not any(os.path.exists(p) for p in here):
          missing.append(f'{rel(path)} cites {name}')
  assert not missing, missing
