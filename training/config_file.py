"""A config file given as PATH[:ARG] (`--config`, a sweep file): imported by path, its
`get_config(ARG)` called and checked, each failure one line (a ConfigError naming the file).

`load_config_file` is the whole of `--config=PATH[:ARG]`; `import_file` is the import by path that
the sweep files share (tools/sweep/spec.py words its own errors).
"""

import glob
import importlib.util
import os
import re
import sys

import ml_collections

from configs import default
from layers.options import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ReadArgs(dict):
  """`configs.default.parse_arg`'s dict that records the keys a config file asks for."""

  def __init__(self, items, read):
    super().__init__(items)
    self._read = read

  def get(self, key, default_value=None):
    self._read.add(key)
    return super().get(key, default_value)

  def __contains__(self, key):
    self._read.add(key)
    return super().__contains__(key)

  def __getitem__(self, key):
    self._read.add(key)
    return super().__getitem__(key)

  def keys(self):  # a file that walks its arguments reads every one of them
    self._read.update(super().keys())
    return super().keys()

  def items(self):
    self._read.update(super().keys())
    return super().items()

  def __iter__(self):
    self._read.update(super().keys())
    return super().__iter__()


def _config_files():
  return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'configs', '*.py'))
                if not os.path.basename(p).startswith('_'))


def import_file(path, prefix):
  """Imports the Python file `path` as a new module named `prefix` + its stem, with the repository
  root importable as train.py's directory makes it (config and sweep files import `configs`).

  Raises:
    SyntaxError: the file's.
    Exception: whatever executing the file raised (callers name the file and turn it into a line).
  """
  name = prefix + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  spec.loader.exec_module(module)
  return module


def load_module(path, what):
  """Imports the Python file `path`; a syntax error or an import that raises is a ConfigError."""
  if not path:
    raise ConfigError(f'{what} is empty; valid: a config file, e.g. configs/decoder_only.py:quick')
  if not os.path.isfile(path):
    raise ConfigError(f'{what}: no such file {path!r}; valid: {", ".join(_config_files())} (or a '
                      'file of your own defining get_config)')
  try:
    return import_file(path, 'cli_config_')
  except SyntaxError as e:
    raise ConfigError(f'{what}: syntax error in {path} line {e.lineno}: {e.msg}') from None
  except Exception as e:  # noqa: BLE001
    raise ConfigError(f'{what}: importing {path} raised {type(e).__name__}: {e}') from None


def call_get_config(module, arg, what, arg_given=True):
  """`module.get_config(arg)`, checked: it exists, does not raise, returns a ConfigDict with model,
  train and data sections, and reads every argument of `arg` (`configs.default.parse_arg` keys).
  `arg_given=False` calls `get_config()` without an argument, as config_flags does for a bare path.
  """
  if not callable(getattr(module, 'get_config', None)):
    raise ConfigError(f'{what}: {module.__file__} defines no get_config(); valid: a file with '
                      '`def get_config(arg=None)` returning an ml_collections.ConfigDict')
  given = default.parse_arg(arg)
  if 'size' in given and given['size'] not in default.SIZES:
    raise ConfigError(f'{what}: size={given["size"]!r} is not valid; valid values: '
                      f'{", ".join(sorted(default.SIZES))}')
  read, calls = set(), []
  parse_arg = default.parse_arg

  def tracked(text=None):
    if text != arg:  # e.g. a file that parses `arg` itself and calls default.get_config()
      return parse_arg(text)
    calls.append(text)
    return _ReadArgs(parse_arg(text), read)

  default.parse_arg = tracked  # a config file reads its arguments through this function
  try:
    config = module.get_config(arg) if arg_given else module.get_config()
  except Exception as e:  # noqa: BLE001
    arg_text = repr(arg) if arg_given else ''
    raise ConfigError(f'{what}: get_config({arg_text}) raised {type(e).__name__}: {e}') from None
  finally:
    default.parse_arg = parse_arg
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f'{what}: get_config() returned {type(config).__name__}, not an '
                      'ml_collections.ConfigDict; valid: a ConfigDict with model, train and data '
                      '(see configs/default.py)')
  missing = [s for s in ('model', 'train', 'data') if s not in config]
  if missing:
    raise ConfigError(f'{what}: the config has no {", ".join(missing)} section; valid: a '
                      'ConfigDict built on configs/default.py\'s get_config()')
  unread = [k for k in given if k not in read]
  if calls and unread:  # only where the file parses its argument the default.py way
    raise ConfigError(f'{what}: argument {unread[0]!r} is not one {module.__file__} reads; valid: '
                      f'{", ".join(sorted(read)) or "none"}')
  return config


def load_config_file(spec):
  """The config `--config=PATH[:ARG]` names, loaded and checked (see `call_get_config`)."""
  path, colon, arg = spec.partition(':')
  module = load_module(path, f'--config={spec}')
  return call_get_config(module, arg if colon else None, f'--config={spec}', bool(colon))


def split_spec(spec):
  """'configs/ablations/x.py:quick' -> ('configs/ablations/x.py', 'quick'); no ARG (or an empty
  one) -> None."""
  path, _, arg = spec.partition(':')
  return path, arg or None
