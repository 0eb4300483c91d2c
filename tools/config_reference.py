"""Writes docs/config.md, the config reference, from configs/default.py's fields and comments.

    python -m tools.config_reference           # writes docs/config.md
    python -m tools.config_reference --check   # exit 1, one line, if docs/config.md is stale

Fields (`section.field = value` in `get_config`) are read with `ast`, comments with `tokenize`. A
field's meaning is its trailing comment and the aligned lines under it, else the comment block
above it (a block above a field with its own comment is a note). Defaults: `get_config()`'s values.
"""

import ast
import io
import os
import re
import sys
import textwrap
import tokenize

from absl import app
from absl import flags

from configs import default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, 'configs', 'default.py')
OUT = os.path.join(ROOT, 'docs/config.md')


def comments(source):
  """Line number -> (comment text after '#', whether the line holds only the comment)."""
  tokens = tokenize.generate_tokens(io.StringIO(source).readline)
  return {t.start[0]: (t.string[1:], not t.line[:t.start[1]].strip())
          for t in tokens if t.type == tokenize.COMMENT}


def block_above(line, notes, used):
  """The comment-only lines just above `line` that no field has claimed, top first."""
  lines = []
  while line - 1 in notes and notes[line - 1][1] and line - 1 not in used:
    line -= 1
    lines.insert(0, notes[line][0])
  used.update(range(line, line + len(lines)))
  return lines


def trailing(stmt, notes, used):
  """The comment after a statement and the aligned comment lines under it ('#   more')."""
  if stmt.end_lineno not in notes or notes[stmt.end_lineno][1]:
    return []
  line = stmt.end_lineno + 1
  while line in notes and notes[line][1] and notes[line][0].startswith('  '):
    used.add(line)
    line += 1
  return [notes[n][0] for n in range(stmt.end_lineno, line)]


def text_of(lines):
  """Comment lines as items; an indented line ('#   pre   Pre-LN') starts one ('pre: ...')."""
  items = []
  for line in lines:
    indent = len(line) - len(line.lstrip())
    if items and (indent < 2 or indent > 5):
      items[-1] += ' ' + line.strip()
    else:
      items.append(re.sub(r'^(\S+)\s{2,}', r'\1: ', line.strip()) if indent > 1 else line.strip())
  return [' '.join(item.split()) for item in items]


def field_of(stmt, aliases):
  """'section.field' of a `section.field = value` statement, or None."""
  target = stmt.targets[0] if len(stmt.targets) == 1 else None
  if isinstance(target, ast.Attribute) and getattr(target.value, 'id', None) in aliases:
    return f'{aliases[target.value.id]}.{target.attr}'
  return None


def if_entry(stmt, source):
  """('if', test, body as written) of an `if` in get_config, e.g. the `quick` switch."""
  body = textwrap.dedent('\n'.join(source.splitlines()[stmt.lineno:stmt.end_lineno]))
  return 'if', ast.get_source_segment(source, stmt.test), body


def field_entries(stmt, name, value, notes, used):
  """The field's entry, after a note if a comment block above it is not its meaning."""
  after, above = trailing(stmt, notes, used), block_above(stmt.lineno, notes, used)
  return ([('note', above)] if after and above else []) + [('field', name, value, after or above)]


def parse(source):
  """The reference as entries: ('section', name, lines), ('note', lines), ('field', name,
  value source, lines) and ('if', test source, body source), in source order."""
  notes, used, aliases, local, entries = comments(source), set(), {}, {}, []
  get_config = next(n for n in ast.parse(source).body if getattr(n, 'name', '') == 'get_config')
  for stmt in get_config.body:
    if isinstance(stmt, ast.If):
      entries.append(if_entry(stmt, source))
    if not isinstance(stmt, ast.Assign):
      continue
    value = ast.get_source_segment(source, stmt.value)
    if isinstance(stmt.value, ast.Call) and len(stmt.targets) == 2:  # config.x = x = ConfigDict()
      aliases[getattr(stmt.targets[1], 'id', '')] = stmt.targets[0].attr
      entries.append(('section', stmt.targets[0].attr, block_above(stmt.lineno, notes, used)))
    for target in (t for t in stmt.targets if isinstance(t, ast.Tuple)):
      local.update((e.id, value) for e in target.elts)  # a, b = SIZES[...]
    if field_of(stmt, aliases):
      entries += field_entries(stmt, field_of(stmt, aliases), local.get(value, value), notes, used)
  return entries


def tables(source):
  """(name, comment lines, source) of the module's UPPER_CASE constants (e.g. the size table)."""
  notes, used, lines = comments(source), set(), source.splitlines()
  return [(s.targets[0].id, block_above(s.lineno, notes, used),
           '\n'.join(lines[s.lineno - 1:s.end_lineno])) for s in ast.parse(source).body
          if isinstance(s, ast.Assign) and getattr(s.targets[0], 'id', '').isupper()]


def escape(text):  # in a table '|' splits cells; '<task>' would read as HTML
  return text.replace('|', '\\|').replace('<', '&lt;')


def default_text(name, value_source, values):
  """The default: a literal as written, else the value `get_config()` gives (and the expression
  it comes from, unless a constructor call)."""
  node = ast.parse(value_source, mode='eval').body
  try:
    ast.literal_eval(node)
    return f'`{value_source}`'
  except ValueError:
    if name not in values:
      return f'`{value_source}`'
    return f'`{values[name]!r}`' + ('' if isinstance(node, ast.Call) else f' (`{value_source}`)')


def paragraph(lines):
  return [escape(' '.join(text_of(lines)))] if lines else []


def render_entry(entry, values, in_table):
  """The markdown lines of one entry of `parse` (a field opens a table unless one is open)."""
  if entry[0] == 'field':
    _, name, value, lines = entry
    meaning = '<br>'.join(escape(item) for item in text_of(lines))
    row = f'| `{name}` | {escape(default_text(name, value, values))} | {meaning} |'
    return [row] if in_table else ['', '| field | default | meaning |', '|---|---|---|', row]
  if entry[0] == 'section':
    return ['', f'## {entry[1]}', ''] + paragraph(entry[2])
  if entry[0] == 'note':
    return [''] + paragraph(entry[1])
  return ['', f'## When `{entry[1]}`', '', '```python', entry[2], '```']


def render(source, values=None, source_name='configs/default.py'):
  """The markdown reference of a config source; `values`: dotted field -> default value."""
  out = ['# Config reference', '', ast.get_docstring(ast.parse(source)) or '', '',
         f'Generated from `{source_name}` by `python -m tools.config_reference`: edit the comments '
         'there, not this file. Set a field with `--config.SECTION.FIELD=VALUE`.']
  in_table = False
  for entry in parse(source):
    out += render_entry(entry, values or {}, in_table)
    in_table = entry[0] == 'field'
  for name, lines, text in tables(source):
    out += ['', f'## {name}', ''] + paragraph(lines) + ['', '```python', text, '```']
  return '\n'.join(line for i, line in enumerate(out) if line or out[i - 1]) + '\n'


def flat_values():
  """Dotted field -> default of configs/default.py's `get_config()`."""
  def walk(tree, prefix):
    for key, value in tree.items():
      yield prefix + key, value
      if isinstance(value, dict):
        yield from walk(value, f'{prefix}{key}.')
  return dict(walk(default.get_config().to_dict(), ''))


def run(check, source_path=SOURCE, out_path=OUT):
  """Writes (or with `check` compares) the reference; returns the exit status."""
  with open(source_path) as f:
    text = render(f.read(), flat_values(), os.path.relpath(source_path, ROOT))
  if check and (not os.path.exists(out_path) or open(out_path).read() != text):
    print(f'{os.path.relpath(out_path, ROOT)} is stale: run python -m tools.config_reference',
          file=sys.stderr)
    return 1
  if not check:
    with open(out_path, 'w') as f:
      f.write(text)
  return 0


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  sys.exit(run(flags.FLAGS.check))


if __name__ == '__main__':
  flags.DEFINE_bool('check', False, 'Exit 1 with one line if docs/config.md is stale.')
  app.run(main)
