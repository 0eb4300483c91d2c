"""The passkey retrieval task's checks (data.task=passkey, data/passkey.py): its config fields, and
the lengths a retrieval report asks of a run, each bad value one line before anything compiles."""

import math

import models
from data import passkey
from data import passkey_text
from layers.options import ConfigError
from training import validation_positions

DEFAULT_MULTIPLES = (1.0, 2.0, 4.0, 8.0)  # the retrieval report's lengths, x data.max_length


def _integer(value):
  return isinstance(value, int) and not isinstance(value, bool)


def _check_depths(depths):
  """data.passkey_depths: (low, high) with 0 <= low <= high <= 1."""
  valid = 'valid: (low, high) with 0 <= low <= high <= 1, e.g. (0.0, 1.0)'
  if not isinstance(depths, (tuple, list)) or len(depths) != 2 or not all(
      isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d)
      for d in depths):
    raise ConfigError(f'data.passkey_depths={depths!r} must be two numbers (low, high); {valid}')
  bad = [d for d in depths if not 0.0 <= d <= 1.0]
  if bad:
    raise ConfigError(f'data.passkey_depths={tuple(depths)!r}: depth {bad[0]!r} is outside [0, 1] '
                      f'(0 = the key right after <bos>, 1 = right before the query); {valid}')
  if depths[0] > depths[1]:
    raise ConfigError(f'data.passkey_depths={tuple(depths)!r}: low > high; {valid}')


def check_config(config):
  """Raises ConfigError on the first bad passkey field of a resolved config; for another task,
  on a passkey field changed from its default (it would be read by nothing)."""
  d, m, t = config.data, config.model, config.train
  if d.task != passkey.TASK:
    for name, default in passkey.DEFAULTS.items():
      value = d.get(name, default)
      if (tuple(value) if isinstance(value, (list, tuple)) else value) != default:
        raise ConfigError(f'data.{name}={value!r} is read only by data.task={passkey.TASK!r} '
                          f'(data.task={d.task!r}); valid here: {default!r} (or set data.task)')
    return
  if not models.spec(m.arch).causal_lm:
    valid = ', '.join(models.archs_where(lambda s: s.causal_lm))
    raise ConfigError(f"data.task='passkey' is a {valid} task (the model reads the prompt and "
                      f'predicts the value); model.arch={m.arch!r} is not valid; '
                      f'valid: {valid}')
  if d.packing != 'none':
    raise ConfigError(f"data.packing={d.packing!r} is not valid for data.task='passkey' (each "
                      'example fills its row of data.max_length tokens); valid: none')
  if t.loss_on != 'target':
    raise ConfigError(f"train.loss_on={t.loss_on!r} is not valid for data.task='passkey' (its rows "
                      "weight the value tokens only); valid: target")
  if d.get('tokenizer', ''):  # the pass key in your text (data.passkey_text)
    _check_depths(d.passkey_depths)
    _check_text_length(d)
    return
  values, words = d.passkey_values, passkey.max_values()
  if not _integer(values) or not 2 <= values <= words:
    raise ConfigError(f'data.passkey_values={values!r} must be an integer from 2 to {words}: the '
                      f"values are words of the tokenizer's vocabulary ({words} words, the markers "
                      'and special tokens aside)')
  value_tokens = d.passkey_value_tokens
  if not _integer(value_tokens) or value_tokens < 1:
    raise ConfigError(f'data.passkey_value_tokens={value_tokens!r} must be a positive integer')
  _check_depths(d.passkey_depths)
  shortest = passkey.min_length(value_tokens)
  if d.max_length < shortest:
    raise ConfigError(f'data.max_length={d.max_length} cannot hold a passkey example with '
                      f'data.passkey_value_tokens={value_tokens} ({passkey.overhead(value_tokens)} '
                      f'tokens besides the filler); valid: data.max_length >= {shortest}')


def _shortest(data_config):
  """The shortest row of a passkey example: the toy task's, or the pass key sentences' tokens with
  data.tokenizer."""
  if data_config.get('tokenizer', ''):
    return passkey_text.min_length(passkey.spec_from_config(data_config))
  return passkey.min_length(data_config.get('passkey_value_tokens', 1))


def _check_text_length(d):
  """passkey with data.tokenizer: data.max_length holds the pass key sentences and some filler."""
  shortest = _shortest(d)
  if d.max_length < shortest:
    raise ConfigError(f'data.max_length={d.max_length} cannot hold the pass key sentences and a '
                      f'filler token ({shortest} tokens with data.tokenizer={d.tokenizer!r}); '
                      f'valid: data.max_length >= {shortest}')


def retrieval_lengths(config, multiples, flag='--lengths'):
  """The lengths in tokens of a retrieval report at `multiples` x data.max_length (empty: the
  default 1, 2, 4, 8); ConfigError for a length under an example's minimum or beyond the run's
  learned position table, with the multiples that are valid."""
  multiples = list(multiples) or list(DEFAULT_MULTIPLES)
  train_length = config.data.max_length
  shortest = _shortest(config.data)
  rows = validation_positions.max_positions(config)
  named = f'{flag}={",".join(f"{x:g}" for x in multiples)}'
  if flag == '--lengths' and multiples == list(DEFAULT_MULTIPLES):
    named = 'the retrieval report (default --lengths=1,2,4,8)'
  lengths = []
  for multiple in multiples:
    length = int(multiple * train_length)
    if length < shortest:
      raise ConfigError(f'{named}: {multiple:g} x data.max_length={train_length} = {length} '
                        f'tokens, under the {shortest} a passkey example needs; valid: multiples '
                        f'>= {shortest / train_length:g}')
    if rows is not None and length > rows:
      raise ConfigError(f'{named}: {multiple:g} x data.max_length={train_length} = {length} '
                        f"positions; the run's position={config.model.position} table has "
                        f'{rows} rows; valid: multiples <= {rows / train_length:g} (e.g. '
                        '--lengths=1)')
    lengths.append(length)
  return lengths
