"""Config options of the registered variants: the error type, the checks, and the base they share.

Every registry in layers/ (attention variants, positions, norms, feed-forward networks, RNN
attention) maps a config string to an entry that declares the `config.model` fields it reads and
checks them itself; training/validation.py only walks the registries (`choice` on the key, then the
entries' checks), so the valid values and their messages are written once, beside the variant.
"""

import math


class ConfigError(ValueError):
  """A config value that cannot work; the message is one line naming the field and what is valid."""


def choice(name, value, valid):
  """Raises ConfigError unless `value` is a key (or member) of `valid`."""
  if value not in valid:
    raise ConfigError(f'{name}={value!r} is not valid; valid values: {", ".join(sorted(valid))}')


def lookup(name, registry, key):
  """`registry[key]`, or the ConfigError of `choice` naming the field `name` and the valid keys."""
  choice(name, key, registry)
  return registry[key]


def positive(name, value, zero_ok=False):
  """Raises ConfigError unless `value` is a finite positive (or, with `zero_ok`, non-negative)
  number: NaN compares false with everything, so a plain `value < 0` would let it (and inf) pass."""
  if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
      or value < 0 or (value == 0 and not zero_ok)):
    raise ConfigError(f'{name}={value!r} must be {"a non-negative" if zero_ok else "a positive"} '
                      'finite number')


def boolean(name, value):
  """Raises ConfigError unless `value` is True or False."""
  if not isinstance(value, bool):
    raise ConfigError(f'{name}={value!r} must be True or False')


class Configurable:
  """A registry entry that reads options from `config.model` and checks them.

  Attributes:
    options: the `config.model` fields this entry reads beyond the shared sizes (documentation,
      and what its checks cover).
  """

  options = ()

  @classmethod
  def resolve_options(cls, model_cfg, data_cfg):
    """Fills this entry's derived defaults in `config.model`, in place (e.g. a length whose 0
    means data.max_length). `training.validation.resolve` calls it for every entry of a registry,
    whichever is chosen: a config carries every field."""
    del model_cfg, data_cfg

  @classmethod
  def check_options(cls, model_cfg):
    """Checks the values of this entry's own fields, whichever entry of its registry is chosen.

    Validation calls it for every entry of a registry: a config carries every field, and these
    are values no choice could use (e.g. `model.rope_base=0.5` is refused under any position).

    Raises:
      ConfigError: one line naming the field and the valid values.
    """
    del model_cfg

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """Checks the options and combinations that matter when this entry is the one chosen.

    Args:
      model_cfg: `config.model`, resolved (`training.validation.resolve`), with valid sizes.
      data_cfg: `config.data` (the training length, the packing).

    Raises:
      ConfigError: one line naming the field and the valid values.
    """
    del model_cfg, data_cfg
