"""data.tokenizer, a Hugging Face tokenizer (data/hf_tokenizer.py): the tasks that take it, its
folder and files, and what the task and model need of it; each bad value one line before anything
compiles."""

import json

import models
from data import hf_tokenizer
from data import passkey
from data import python_code
from layers.options import ConfigError

TASKS = ('text_lm', python_code.TASK, passkey.TASK)  # the tasks data.tokenizer is valid with
MAX_DIGITS = 18  # the longest pass key (PI's has 5; longer ones only lengthen the value)


def folder(data_config) -> str:
  """data.tokenizer as set ('' when unset)."""
  return data_config.get('tokenizer', '') or ''


def reads_files(data_config) -> bool:
  """Whether data.files is read by a task beyond text_pairs / text_lm: passkey with data.tokenizer
  (its filler is data.files.train)."""
  return data_config.task == passkey.TASK and bool(folder(data_config))


def _load(name):
  """The tokenizer of data.tokenizer=name, its failures as ConfigError lines."""
  try:
    return hf_tokenizer.HFTokenizer.load(hf_tokenizer.resolve(name), f'data.tokenizer={name!r}')
  except hf_tokenizer.TokenizerError as e:
    raise ConfigError(str(e)) from None
  except (ValueError, json.JSONDecodeError) as e:  # tokenizers' own parse errors are ValueErrors
    raise ConfigError(f'data.tokenizer={name!r}: its files cannot be read ('
                      f'{str(e).splitlines()[0]}); valid: a Hugging Face tokenizer.json and '
                      'tokenizer_config.json') from None


def check_config(config):
  """Raises ConfigError on a bad data.tokenizer: set for a task that does not take it, a folder
  without tokenizer.json, a tokenizer without an eos (or without the mask a masking model needs),
  or passkey without data.files.train or with a bad data.passkey_digits."""
  d, m = config.data, config.model
  name = d.get('tokenizer', '')
  if not isinstance(name, str):
    raise ConfigError(f"data.tokenizer={name!r} must be a folder (a str); valid: '' or a folder "
                      'with a Hugging Face tokenizer.json')
  if not name:
    return
  if d.task not in TASKS:
    raise ConfigError(f'data.tokenizer={name!r} is read only by data.task {", ".join(TASKS)} '
                      f"(data.task={d.task!r} brings its own tokenizer); valid here: ''")
  tokenizer = _load(name)
  if tokenizer.mask_id is None and models.spec(m.arch).batch_format == 'same_token':
    raise ConfigError(f'data.tokenizer={name!r} has no mask_token, which model.arch={m.arch!r} '
                      'masks its inputs with; valid: a tokenizer with a mask token, or archs '
                      f'{", ".join(models.archs_where(lambda s: s.causal_lm))}')
  if d.task == passkey.TASK:
    _check_passkey(d)


def _check_passkey(d):
  """passkey with data.tokenizer: the filler file and the key's digits."""
  train = (d.get('files', None) or {}).get('train', '')
  if not isinstance(train, str) or not train.strip():
    raise ConfigError(f"data.files.train={train!r} must name a file of one document per line for "
                      "data.task='passkey' with data.tokenizer (its documents are the filler)")
  digits = d.get('passkey_digits', passkey.DEFAULTS['passkey_digits'])
  if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= MAX_DIGITS:
    raise ConfigError(f'data.passkey_digits={digits!r} must be an integer from 1 to {MAX_DIGITS} '
                      '(the digits of the pass key)')
