"""The config reference (tools/config_reference.py): docs/config.md is current, and the generator
reads fields, defaults and every comment layout of a config source."""

import textwrap

from tools import config_reference

SOURCE = textwrap.dedent('''\
    """A tiny config."""

    import ml_collections

    # Sizes: one table.
    SIZES = {'s': (2, 8)}


    def get_config(arg=None):
      config = ml_collections.ConfigDict()
      # What the model is.
      config.model = model = ml_collections.ConfigDict()
      model.kind = 'a'  # a | b, and the line under it
      #                   continues the comment
      num_layers, width = SIZES['s']
      model.num_layers = num_layers  # blocks
      # Where the norm sits:
      #   pre    before f
      #   post   after f,
      #          with no final norm
      model.norm = 'pre'
      # about the fields below
      model.rate = 1e-3  # learning rate; must be < 1
      model.files = ml_collections.ConfigDict({'train': ''})
      if arg:
        model.kind = 'b'  # the switch
      return config
    ''')
VALUES = {'model.kind': 'a', 'model.num_layers': 2, 'model.norm': 'pre', 'model.rate': 1e-3,
          'model.files': {'train': ''}}


def test_docs_config_md_is_current(capsys):
  """Fails when configs/default.py changed and docs/config.md was not regenerated."""
  status = config_reference.run(check=True)
  assert status == 0, capsys.readouterr().err + 'run: python -m tools.config_reference'


def test_parse_reads_every_comment_layout():
  entries = config_reference.parse(SOURCE)
  assert entries == [
      ('section', 'model', [' What the model is.']),
      ('field', 'model.kind', "'a'", [' a | b, and the line under it',
                                      '                   continues the comment']),
      ('field', 'model.num_layers', "SIZES['s']", [' blocks']),
      ('field', 'model.norm', "'pre'", [' Where the norm sits:', '   pre    before f',
                                        '   post   after f,', '          with no final norm']),
      ('note', [' about the fields below']),
      ('field', 'model.rate', '1e-3', [' learning rate; must be < 1']),
      ('field', 'model.files', "ml_collections.ConfigDict({'train': ''})", []),
      ('if', 'arg', "model.kind = 'b'  # the switch"),
  ]


def test_render_gives_one_row_per_field_with_its_default_and_meaning():
  text = config_reference.render(SOURCE, VALUES, 'tiny.py')
  rows = [line for line in text.splitlines() if line.startswith('| `')]
  assert rows == [
      "| `model.kind` | `'a'` | a \\| b, and the line under it continues the comment |",
      "| `model.num_layers` | `2` (`SIZES['s']`) | blocks |",
      "| `model.norm` | `'pre'` | Where the norm sits:<br>pre: before f<br>post: after f, with no "
      'final norm |',
      '| `model.rate` | `1e-3` | learning rate; must be &lt; 1 |',
      "| `model.files` | `{'train': ''}` |  |",
  ]
  assert text.startswith('# Config reference\n\nA tiny config.\n\nGenerated from `tiny.py`')
  assert '## model\n\nWhat the model is.\n' in text
  assert '\n\nabout the fields below\n\n| field |' in text  # a note splits the table
  assert "## When `arg`\n\n```python\nmodel.kind = 'b'  # the switch\n```" in text
  assert "## SIZES\n\nSizes: one table.\n\n```python\nSIZES = {'s': (2, 8)}\n```" in text


def test_check_exits_1_with_one_line_when_stale(tmp_path, capsys):
  out = tmp_path / 'reference.txt'
  assert config_reference.run(check=False, out_path=str(out)) == 0
  assert config_reference.run(check=True, out_path=str(out)) == 0
  out.write_text(out.read_text().replace('model.d_model', 'model.width'))
  assert config_reference.run(check=True, out_path=str(out)) == 1
  err = capsys.readouterr().err
  assert err.count('\n') == 1
  assert 'reference.txt is stale: run python -m tools.config_reference' in err
  assert config_reference.run(check=True, out_path=str(tmp_path / 'absent.txt')) == 1


def test_no_field_is_shadowed_by_a_configdict_method():
  """A field named like a ConfigDict method (keys, values, items, get, update, ...) reads as the
  method in `config.data.FIELD`, and `--config.data.FIELD=V` fails: every field of
  configs/default.py must read back as its own value."""
  import ml_collections
  from configs import default
  methods = {name for name in dir(ml_collections.ConfigDict) if not name.startswith('_')}

  def walk(node, prefix):
    for name in node.keys():
      assert name not in methods, f'{prefix}{name} is shadowed by ConfigDict.{name}'
      value = node[name]
      if isinstance(value, ml_collections.ConfigDict):
        walk(value, f'{prefix}{name}.')

  walk(default.get_config(), '')
