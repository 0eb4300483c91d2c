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
import re
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


# The documentation: the markdown files at the root, in benchmarks/ and under docs/. It cites files
# by path and the code by dotted name (`training.loop.jit_train_step`, `loop.jit_train_step`);
# both must exist, so a renamed module or function fails here instead of misleading a reader.
DOCS = sorted([os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith('.md')]
              + [os.path.join(d, f) for top in ('benchmarks', 'docs')
                 for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith('.md')])
MD_NAME = re.compile(r'(?<![\w/.-])((?:\.\.?/|[\w-]+/)*[\w-]+\.md)\b')
LINK = re.compile(r'\]\(([^)\s#]+)')
REPO_PATH = re.compile(r'(?<![\w./-])((?:%s)/[\w./-]*\.\w+)' % '|'.join(PACKAGES + ('docs',)))
CODE_SPAN = re.compile(r'`([^`\n]+)`')
DOTTED = re.compile(r'(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)')
# A dotted name with one of these parts is a file name (eval.json, train.py), not code.
FILE_PARTS = {'py', 'md', 'json', 'jsonl', 'png', 'log', 'txt', 'tsv', 'gz', 'txtpb', 'toml', 'cfg'}
PLACEHOLDER = re.compile(r'(?:^|/)(?!README|ARCHITECTURE)[A-Z][A-Z_]+(?:[./]|$)')  # NAME.py, DIR/


def cited_paths(path, text):
  """(what, candidates): every file `text` cites, with the places it may be relative to.

  A link's text (`[config.md](docs/config.md)`) is no citation; its target is. A path after the
  word 'new' is a file the reader is told to create.
  """
  here = os.path.dirname(path)
  for name in set(MD_NAME.findall(re.sub(r'\[[^\]\n]*\]\(', '(', text))):
    yield name, [os.path.join(here, name), os.path.join(ROOT, name)]
  if path in DOCS:
    for link in {l for l in LINK.findall(text) if ':' not in l}:
      yield link, [os.path.join(here, link)]
    for match in REPO_PATH.finditer(text):
      if not PLACEHOLDER.search(match[1]) and not text[:match.start()].endswith(('new ', 'new `')):
        yield match[1], [os.path.join(ROOT, match[1])]


def test_no_citation_of_a_file_the_repository_lacks():
  """Every markdown file a source or doc cites exists; in a doc, every link and repository path."""
  missing = []
  for path in [p for _, p in FILES] + DOCS:
    with open(path) as f:
      text = f.read()
    for name, candidates in cited_paths(path, text):
      if not any(os.path.exists(p) for p in candidates):
        missing.append(f'{rel(path)} cites {name}')
  assert not missing, sorted(set(missing))


def modules():
  """Dotted module name -> file, for every project module ('training.loop', 'training', 'train')."""
  out = {}
  for _, path in FILES:
    name = rel(path)[:-len('.py')].replace(os.sep, '.')
    out[name[:-len('.__init__')] if name.endswith('.__init__') else name] = path
  return out


def defined_names(node):
  """name -> node of all a module or class body defines (defs, classes, assignments, imports, and
  in a class `self.x = ...` in its methods), inside if/try/with blocks too, not in functions."""
  out = {}
  for child in ast.iter_child_nodes(node):
    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out[child.name] = child
      if isinstance(node, ast.ClassDef):
        out.update((n.attr, n) for n in ast.walk(child) if isinstance(n, ast.Attribute)
                   and isinstance(n.ctx, ast.Store) and getattr(n.value, 'id', '') == 'self')
    elif isinstance(child, (ast.Import, ast.ImportFrom)):
      out.update((a.asname or a.name.split('.')[0], child) for a in child.names)
    elif isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
      targets = child.targets if isinstance(child, ast.Assign) else [child.target]
      out.update((n.id, child) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    elif isinstance(child, (ast.stmt, ast.excepthandler)):
      out.update(defined_names(child))
  return out


def missing_attribute(path, rest):
  """The first of `rest` (an attribute, then a class member) that the module at `path` lacks."""
  if not rest:
    return None
  with open(path) as f:
    node = defined_names(ast.parse(f.read(), path)).get(rest[0])
  if node is None:
    return rest[0]
  if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in defined_names(node):
    return '.'.join(rest[:2])
  return None


def dotted_name_error(name, mods, fields):
  """Why the code `name` cites does not exist; None if it does or if its first part is no module."""
  parts = name.split('.')
  if name in fields or FILE_PARTS & set(parts[1:]):
    return None
  starts = [parts[0]] if parts[0] in mods else sorted(m for m in mods if m.endswith('.' + parts[0]))
  errors = []
  for module in starts:
    rest = parts[1:]
    while rest and f'{module}.{rest[0]}' in mods:
      module, rest = f'{module}.{rest[0]}', rest[1:]
    missing = missing_attribute(mods[module], rest)
    if missing is None:
      return None
    errors.append(f'{module} has no {missing}')
  return '; '.join(errors) or None


def code_in(text):
  """The text of every `code span`, indented code line and fenced block of a markdown file."""
  fenced = re.findall(r'^```[^\n]*\n(.*?)^```', text, re.S | re.M)
  indented = [line for line in text.splitlines() if line.startswith('    ')]
  return CODE_SPAN.findall(text) + fenced + indented


def config_fields():
  """Every field path of configs/default.py ('train.steps', 'data.files', 'data.files.train')."""
  from tools import config_reference
  return set(config_reference.flat_values())


def test_docs_name_only_code_that_exists():
  """`module.function` in a doc names a module of the repository and something it defines."""
  mods, fields, stale = modules(), config_fields(), []
  for path in DOCS:
    with open(path) as f:
      names = {n for code in code_in(f.read()) for n in DOTTED.findall(code)}
    stale += [f'{rel(path)}: `{n}`: {e}' for n in sorted(names)
              if (e := dotted_name_error(n, mods, fields))]
  assert not stale, stale


def test_docs_are_short():
  """No markdown file over 500 lines: split a long page by concern."""
  lines = {rel(p): sum(1 for _ in open(p)) for p in DOCS}
  assert all(n <= 500 for n in lines.values()), {p: n for p, n in lines.items() if n > 500}


def test_the_doc_check_finds_renamed_code_and_leaves_other_names_alone():
  mods, fields = modules(), config_fields()
  for name in ('training.loop.jit_train_step', 'loop.jit_train_step', 'training.loop',
               'layers.sharding.DEFAULT_RULES', 'training.persist.StopSignals.stop_after',
               'model.d_model', 'train.steps', 'data.files.train', 'eval.json', 'jax.jit'):
    assert dotted_name_error(name, mods, fields) is None, name
  for name, error in (('training.loop.train', 'training.loop has no train'),
                      ('train.tune_host_malloc', 'train has no tune_host_malloc'),
                      ('persist.StopSignals.stop', 'training.persist has no StopSignals.stop')):
    assert dotted_name_error(name, mods, fields) == error
  code = code_in('Run `python -m tools.aot`, not tools.sweep in prose:\n\n    loop.train()\n')
  assert [n for c in code for n in DOTTED.findall(c)] == ['tools.aot', 'loop.train']
