"""The command lines' input checks: each bad input is one line naming the flag or field and what is
valid, with exit status 2, before anything compiles.

`flags_parser` replaces absl's (whose errors take two lines and exit 1) for train.py, eval.py and
tools.sweep; before absl parses `--config` it loads the config file here, so that a missing file, a
syntax error, a `get_config` that raises or returns no ConfigDict, an argument nothing reads and
an override of a field the config lacks are named instead of ending in a traceback. The checks of
a run (`check_train_run`) follow; eval.py's flags are checked in training/eval_checks.py.
"""

import difflib
import glob
import importlib.util
import os
import re
import sys

from absl import flags
import ml_collections

from configs import default
from data import pipeline
from data import python_code
from data import text_corpus
from layers.options import ConfigError
from training import distributed
from training import paths
from training import validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OVERRIDE = re.compile(r'^--?(?:no)?config\.([^=]+)(?:=(.*))?$')
_TYPE_NAMES = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'a string',
               tuple: 'a tuple', list: 'a list'}


def fail(prefix, message, status=2):
  """Prints `prefix: message` as one line on stderr and exits with `status`."""
  print(f'{prefix}: {" ".join(str(message).split())}', file=sys.stderr)
  sys.exit(status)


def exit_now(status):
  """Ends the process with `status` once the output is flushed, without waiting for other threads:
  after a failed checkpoint save, Orbax's background threads wait for a signal that never comes,
  and the interpreter's shutdown would wait for them for ever."""
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)


# --- The config file -------------------------------------------------------------------------

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


def load_module(path, what):
  """Imports the Python file `path`; a syntax error or an import that raises is a ConfigError."""
  if not path:
    raise ConfigError(f'{what} is empty; valid: a config file, e.g. configs/decoder_only.py:quick')
  if not os.path.isfile(path):
    raise ConfigError(f'{what}: no such file {path!r}; valid: {", ".join(_config_files())} (or a '
                      'file of your own defining get_config)')
  name = 'cli_config_' + re.sub(r'\W', '_', os.path.splitext(os.path.basename(path))[0])
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # config files import `configs`, as train.py's directory allows
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f'{what}: syntax error in {path} line {e.lineno}: {e.msg}') from None
  except Exception as e:  # noqa: BLE001
    raise ConfigError(f'{what}: importing {path} raised {type(e).__name__}: {e}') from None
  return module


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


def check_field(config, path, flag):
  """Raises ConfigError unless the dotted `path` is a field of `config` (an override's target)."""
  node, done = config, []
  for part in path.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      where = '.'.join(done) or 'the config'
      fields = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(part, fields, n=1)
      hint = f' (did you mean {".".join(done + close)}?)' if close else ''
      valid = f'; valid fields of {where}: {", ".join(fields)}' if fields else ''
      raise ConfigError(f'{flag}: {where} has no field {part!r}{hint}{valid}')
    done.append(part)
    node = node[part]


def _value_error_line(error, config):
  """absl's IllegalFlagValueError as one line naming the flag (or config field) and what is
  valid."""
  message = ' '.join(str(error).split())
  match = re.match(r'flag --(\S+?)=(.*?): (.*)$', message)
  if not match:
    return message
  name, value, why = match.groups()
  if name.startswith('config.') and config is not None:
    node = config
    for part in name.split('.')[1:]:
      node = node[part]
    expected = _TYPE_NAMES.get(type(node), type(node).__name__)
    return f'{name[7:]}={value!r} is not valid ({why}); valid: {expected}, e.g. {node!r}'
  kind = flags.FLAGS[name].flag_type() if name in flags.FLAGS else ''
  expected = {'int': 'an integer', 'float': 'a number', 'bool': 'true or false'}.get(kind)
  return f'--{name}={value} is not valid ({why})' + (f'; valid: {expected}' if expected else '')


def flags_parser(program):
  """An `app.run` flags parser for `program` ('train', 'eval', 'sweep'): absl's parsing, with the
  config file and its overrides checked first and every error as one line with exit status 2."""
  def parse(argv):
    config = None
    try:
      argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
      if 'config' in flags.FLAGS:
        specs = [a.split('=', 1)[1] for a in argv if a.startswith(('--config=', '-config='))]
        specs += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ('--config', '-config')]
        if specs:
          config = load_config_file(specs[-1])
          for a in argv:
            match = _OVERRIDE.match(a)
            if match:
              check_field(config, match.group(1), a)
      return flags.FLAGS(argv)
    except ConfigError as e:
      fail('config error', e)
    except flags.IllegalFlagValueError as e:
      fail('config error' if 'flag --config.' in str(e) else program, _value_error_line(e, config))
    except flags.Error as e:
      fail(program, e)
  return parse


# --- A training run --------------------------------------------------------------------------

def check_workdir(workdir, valid='a directory (train.py creates it)'):
  """Raises ConfigError for a missing or empty --workdir; `valid` says what it must be."""
  if workdir is None:
    raise ConfigError(f'--workdir is required; valid: {valid}')
  if not workdir.strip():
    raise ConfigError('--workdir is empty; valid: a directory path (an empty one would mean the '
                      'current directory)')


def check_train_run(config, workdir):
  """Everything about a training run that can be checked before compiling: the config's fields
  (missing ones named), the workdir and data_dir, and the mesh against the devices. Returns the
  resolved config."""
  check_workdir(workdir)
  try:
    config = validation.resolve(config)
    validation.validate(config)
  except (AttributeError, KeyError) as e:  # a config file that left out a field default.py has
    raise ConfigError(f'the config lacks a field ({type(e).__name__}: {e}); valid: every field of '
                      'configs/default.py') from None
  for what, path in (('--workdir', workdir), ('data.data_dir', config.data.data_dir),
                     ('train.init_from', config.train.get('init_from', ''))):
    if path:
      paths.check_store_reachable(path, what)
  validation.check_writable('workdir', workdir)
  for name in ('checkpoints',):  # the directories the run writes into
    path = paths.join(workdir, name)
    if paths.exists(path) and not paths.isdir(path):
      raise ConfigError(f'{path} is a file, where the run keeps its checkpoints; valid: a '
                        'directory (move the file away, or use a new --workdir)')
  validation.check_writable('data.data_dir', config.data.data_dir)
  distributed.make_mesh(config)  # the sizes' product against the device count
  check_corpus(config, workdir)  # a resumed run: before new files get a tokenizer of their own
  return config


def check_corpus(config, workdir):
  """For data.task text_pairs / text_lm: the input files against those the run in `workdir`
  started training on (run_info.json 'corpus', written by the loop; a new run has none).

  Changed files would be prepared into a new folder with a new tokenizer, silently paired with the
  run's model. Raises text_corpus.DataError naming the file that changed.
  """
  spec = pipeline.text_spec(config.data)
  if spec is None:
    return
  path = paths.join(workdir, 'run_info.json')
  info = paths.read_json(path) if paths.exists(path) else {}
  code = info.get('python_code')
  if code and config.data.get('task') == python_code.TASK:  # the interpreter and files first
    now = python_code.corpus_of(config.data).record()
    if (now['python'], now['files_hash']) != (code['python'], code['files_hash']):
      raise text_corpus.DataError(
          f"data.task='python_code': this run trained on the stdlib of Python {code['python']} "
          f"(files hash {code['files_hash']}); this interpreter and data.code_max_files give "
          f"Python {now['python']} (files hash {now['files_hash']}); valid: the same "
          'interpreter and data.code_max_files, or a new workdir')
  recorded = info.get('corpus')
  if recorded:  # runs from before the record: nothing to compare with
    text_corpus.check_fingerprint(recorded, spec)
