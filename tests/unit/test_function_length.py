"""No function over 80 lines unless it says why: an `ast` check of every project module.

Every `def` (module functions, methods, nested functions; async ones too) in every .py file of the
repository outside tests/ and the virtualenv is measured from its `def` line to its last line. One
longer than MAX_LINES fails the test, named as `file:function:length`, unless a comment
`# long: <reason>` sits on its `def` line or on the line directly above it (above the first
decorator of a decorated function). The reason is required: `# long:` alone does not count.
"""

import ast
import os
import re
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_LINES = 80
SKIPPED_DIRS = {'tests', '__pycache__', 'build', 'dist', 'node_modules'}  # and hidden ones
LONG = re.compile(r'#\s*long:\s*\S')  # `# long: <reason>`

# Functions over the limit that are being split now, as `path:function`. This set must shrink to
# empty: remove an entry once its function is split (test_pending_functions_are_still_long fails
# until then), and never add one: split a new long function, or give it a `# long: <reason>`.
PENDING = set()


def python_files(root=ROOT):
  """The project's .py files (paths relative to `root`), tests/ and hidden directories aside."""
  for directory, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.') and d not in SKIPPED_DIRS
                     and not d.endswith('.egg-info'))
    for name in sorted(files):
      if name.endswith('.py'):
        yield os.path.relpath(os.path.join(directory, name), root)


def functions(tree, prefix=''):
  """(qualified name, node) of every function in `tree`: `f`, `Class.method`, `outer.inner`."""
  for node in ast.iter_child_nodes(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      name = prefix + node.name
      if not isinstance(node, ast.ClassDef):
        yield name, node
      yield from functions(node, name + '.')
    else:
      yield from functions(node, prefix)


def length(node):
  """Lines from the `def` line (decorators aside) to the function's last line."""
  return node.end_lineno - node.lineno + 1


def marked_long(lines, node):
  """Whether `# long: <reason>` is on the `def` line or the line above it (or above the first
  decorator)."""
  first = min([node.lineno] + [d.lineno for d in node.decorator_list])
  candidates = {node.lineno, node.lineno - 1, first - 1}
  return any(LONG.search(lines[n - 1]) for n in candidates if 1 <= n <= len(lines))


def long_functions(source, path='<source>'):
  """[(function, length)] of the functions in `source` over MAX_LINES that carry no reason."""
  lines = source.splitlines()
  return [(name, length(node)) for name, node in functions(ast.parse(source, path))
          if length(node) > MAX_LINES and not marked_long(lines, node)]


def offenders():
  """{'path:function': length} of every function of the project over the limit without a
  reason."""
  out = {}
  for path in python_files():
    with open(os.path.join(ROOT, path)) as f:
      source = f.read()
    for name, lines in long_functions(source, path):
      out[f'{path}:{name}'] = lines
  return out


def test_no_function_is_longer_than_80_lines():
  found = offenders()
  new = sorted(f'{key}:{lines}' for key, lines in found.items() if key not in PENDING)
  assert not new, (f'functions over {MAX_LINES} lines (file:function:length): {new}; split them '
                   'where the logic has seams, or mark one that must stay long with a comment '
                   '`# long: <reason>` on its def line')


def test_pending_functions_are_still_long():
  """PENDING only shrinks: a function split (or renamed) since must leave the set."""
  found = offenders()
  done = sorted(key for key in PENDING if key not in found)
  assert not done, f'no longer over {MAX_LINES} lines: remove {done} from PENDING'


def _function(name, body_lines, comment='', above=''):
  """Source of a function whose body is `body_lines` lines (its length: body_lines + 1)."""
  head = ([above] if above else []) + [f'def {name}():{comment}']
  return '\n'.join(head + ['  x = 1'] * body_lines) + '\n'


def test_the_check_counts_def_to_last_line_and_honours_only_a_reason():
  assert long_functions(_function('ok', 79)) == []  # 80 lines: at the limit
  assert long_functions(_function('f', 80)) == [('f', 81)]
  assert long_functions(_function('f', 80, '  # long: one comment per config field')) == []
  assert long_functions(_function('f', 80, above='# long: a table of golden values')) == []
  assert long_functions(_function('f', 80, '  # long:')) == [('f', 81)]  # no reason given
  assert long_functions(_function('f', 80, above='# a comment')) == [('f', 81)]
  decorated = '# long: generated\n@functools.cache\n' + _function('f', 80)
  assert long_functions(decorated) == []


def test_the_check_finds_methods_and_nested_functions():
  method = textwrap.indent(_function('helper', 81).replace('():', '(self):'), '  ')
  nested = textwrap.indent(_function('inner', 85), '  ')
  source = '\n'.join([
      'class Model:', '', '  def short(self):', '    pass', '', method,
      'def outer():', nested + '  return inner', '',
      'async def fetch():', '  x = 1\n' * 90])
  assert sorted(long_functions(source)) == [
      ('Model.helper', 82), ('fetch', 91), ('outer', 88), ('outer.inner', 86)]
