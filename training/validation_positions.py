"""The position method's fields beyond its own checks, derived from the methods' declarations
(`layers.positions.Position`): the options only some methods read, randomized position ids, the
fields eval.py may change, and the positions a trained model takes."""

from layers import options
from layers import positions

ConfigError = options.ConfigError


def check_config(config):
  """Raises ConfigError for an option set under a method that does not read it (`exclusive_options`)
  and for `model.random_positions_max` under a method without absolute ids (`random_ids`)."""
  m = config.model
  chosen = positions.POSITIONS[m.position]
  for method in positions.POSITIONS.values():
    for field, (off, what) in method.exclusive_options.items():
      value = m.get(field, off)
      if value != off and field not in chosen.exclusive_options:
        owners = [name for name, p in positions.POSITIONS.items() if field in p.exclusive_options]
        raise ConfigError(f'model.{field}={value!r} {what}, which model.position={m.position!r} '
                          f'does not use; valid here: {off!r} (or model.position'
                          f'{_one_of(owners)})')
  _check_random_positions(config)


def _one_of(names):
  """How a message offers the methods `names`: "='x'" or " in: x, y"."""
  return f'={names[0]!r}' if len(names) == 1 else f' in: {", ".join(names)}'


def _check_random_positions(config):
  """`model.random_positions_max` (Ruoss et al. 2023): an integer N >= data.max_length, for the
  position methods that read absolute position ids."""
  m = config.model
  n = m.get('random_positions_max', 0)
  if not isinstance(n, int) or isinstance(n, bool) or n < 0:
    raise ConfigError(f'model.random_positions_max={n!r} must be an integer >= 0 (0 = off)')
  if not n:
    return
  if not positions.POSITIONS[m.position].random_ids:
    raise ConfigError(f'model.random_positions_max={n} needs model.position in '
                      f'{", ".join(positions.RANDOM_POSITIONS)}, not {m.position!r} '
                      '(or set it to 0)')
  if n < config.data.max_length:
    raise ConfigError(f'model.random_positions_max={n} must be >= data.max_length='
                      f'{config.data.max_length} (T distinct positions are drawn from [0, N))')


def max_positions(config):
  """The most positions the run's model takes (None: any number): its method's `max_positions` at
  the training length data.max_length (a learned table's rows, random_positions_max included)."""
  m = config.model
  return positions.POSITIONS[m.position].max_positions(m, config.data.max_length)


def check_eval_options(config, flag, fields):
  """Raises ConfigError unless the run's position method declares every `config.model` field in
  `fields` as one eval.py may change (`eval_options`); `flag` is how the message names the input.
  The changed config is then validated as a whole by the caller."""
  m = config.model
  if set(fields) <= set(positions.POSITIONS[m.position].eval_options):
    return
  owners = [name for name, p in positions.POSITIONS.items() if set(fields) <= set(p.eval_options)]
  raise ConfigError(f'{flag} needs a run with model.position{_one_of(owners)}; this one has '
                    f'{m.position!r}')
