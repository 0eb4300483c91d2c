"""The command lines' shared input checks: each bad input is one line naming the flag or field and
what is valid, with exit status 2, before anything compiles.

`flags_parser` replaces absl's (whose errors take two lines and exit 1) for train.py, eval.py,
tools.sweep and tools.aot; before absl parses `--config` it loads the config file
(training/config_file.py), so that a missing file, a syntax error, a `get_config` that raises or
returns no ConfigDict, an argument nothing reads and an override of a field the config lacks are
named instead of ending in a traceback. A training run's checks are in training/train_checks.py,
eval.py's in training/eval_checks.py.
"""

import difflib
import os
import re
import sys

from absl import flags
import ml_collections

from layers.options import ConfigError
from training import config_file

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
          config = config_file.load_config_file(specs[-1])
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


def check_workdir(workdir, valid='a directory (train.py creates it)'):
  """Raises ConfigError for a missing or empty --workdir; `valid` says what it must be."""
  if workdir is None:
    raise ConfigError(f'--workdir is required; valid: {valid}')
  if not workdir.strip():
    raise ConfigError('--workdir is empty; valid: a directory path (an empty one would mean the '
                      'current directory)')
