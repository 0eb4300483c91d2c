"""The synthetic tasks' checks (data.task = mqar | induction | selective_copy | memorize,
data/synthetic.py): the data.synthetic knobs against what a row can hold, each bad value one line
before anything compiles."""

import models
from data import synthetic
from layers.options import ConfigError


def _integer(value):
  return isinstance(value, int) and not isinstance(value, bool)


def knobs(data_config) -> dict:
  """The data.synthetic fields of a data config, defaults filled in."""
  given = data_config.get('synthetic', None) or {}
  return {name: given.get(name, default) for name, default in synthetic.DEFAULTS.items()}


def check_config(config):
  """Raises ConfigError on the first bad synthetic field of a resolved config; for another task,
  on a data.synthetic field changed from its default (nothing would read it), and for a synthetic
  task, on a field that task does not read."""
  d, m, t = config.data, config.model, config.train
  values = knobs(d)
  if d.task not in synthetic.TASKS:
    for name, default in synthetic.DEFAULTS.items():
      if values[name] != default:
        raise ConfigError(f'data.synthetic.{name}={values[name]!r} is read only by data.task in '
                          f'{", ".join(synthetic.READ_BY[name])} (data.task={d.task!r}); valid '
                          f'here: {default!r} (or set data.task)')
    return
  task = d.task
  for name, default in synthetic.DEFAULTS.items():
    if task not in synthetic.READ_BY[name] and values[name] != default:
      raise ConfigError(f'data.synthetic.{name}={values[name]!r} is not read by data.task='
                        f'{task!r} (only by {", ".join(synthetic.READ_BY[name])}); valid here: '
                        f'{default!r}')
  if not models.spec(m.arch).causal_lm:
    valid = ', '.join(models.archs_where(lambda s: s.causal_lm))
    raise ConfigError(f'data.task={task!r} is a {valid} task (each row is read left to right '
                      f'and scored where it says); model.arch={m.arch!r} is not valid; valid: '
                      f'{valid}')
  if d.packing != 'none':
    raise ConfigError(f'data.packing={d.packing!r} is not valid for data.task={task!r} (each '
                      'example fills its row of data.max_length tokens); valid: none')
  if t.loss_on != 'target':
    raise ConfigError(f'train.loss_on={t.loss_on!r} is not valid for data.task={task!r} (its rows '
                      'weight the scored tokens only); valid: target')
  for name in ('pairs', 'key_vocab', 'value_vocab'):
    if name in values and task in synthetic.READ_BY[name] and (
        not _integer(values[name]) or values[name] < 1):
      raise ConfigError(f'data.synthetic.{name}={values[name]!r} must be a positive integer')
  pairs, queries = values['pairs'], values['queries']
  if task == 'mqar' and (not _integer(queries) or not 0 <= queries <= pairs):
    raise ConfigError(f'data.synthetic.queries={queries!r} asks more keys than the '
                      f'{pairs} pairs of a row (data.synthetic.pairs); valid: 0 (every key) to '
                      f'{pairs}')
  if task in synthetic.READ_BY['key_vocab'] and values['key_vocab'] < pairs:
    raise ConfigError(f'data.synthetic.key_vocab={values["key_vocab"]} is too small for {pairs} '
                      f'distinct keys a row (data.synthetic.pairs={pairs}); valid: key_vocab >= '
                      f'{pairs}')
  least = synthetic.min_values(task, pairs)
  if values['value_vocab'] < least:
    raise ConfigError(f'data.synthetic.value_vocab={values["value_vocab"]} is too small for '
                      f'data.task={task!r} with data.synthetic.pairs={pairs}; '
                      'valid: value_vocab >= '
                      f'{least}')
  queried = (queries or pairs) if task == 'mqar' else 0
  shortest = synthetic.min_length(task, pairs, queried)
  if d.max_length < shortest:
    what = (f'{pairs} pairs and {queried} queries' if task == 'mqar' else f'{pairs} pairs'
            if task == 'memorize' else f'data.synthetic.pairs={pairs}')
    raise ConfigError(f'data.max_length={d.max_length} cannot hold a {task} row with {what} '
                      f'(data.synthetic); valid: data.max_length >= {shortest}, or fewer pairs')
