"""A sweep file (configs/ablations/*.py) as named cells: expansion, names, configs and commands.

The file format is documented in tools/sweep/__main__.py, the runner that launches the cells.
"""

import hashlib
import inspect
import itertools
import os
import re

from layers import options
from models import accounting
from training import config_file
from training import paths
from training import state as state_lib
from training import validation
from tools import accounting as tools_accounting

SWEEP_KEYS = ('grid', 'cells', 'seeds', 'eval_flags', 'eval_variants', 'ladder')
BUDGET = 'ladder.flops'  # a ladder cell's pseudo-field: its training-FLOP budget (sets train.steps)
_UNSAFE = re.compile(r'[^A-Za-z0-9._=,+-]')
MAX_NAME = 200  # characters; longer names are cut and end in a hash of the full name


class SweepError(ValueError):
  """A sweep file that cannot be expanded; the message names the problem."""


def load_sweep_module(path):
  """Imports a sweep file by path (training.config_file.import_file, as for a config file)."""
  if not os.path.exists(path):
    raise SweepError(f'sweep file {path} does not exist')
  try:
    module = config_file.import_file(path, 'sweep_')
  except SyntaxError as e:
    raise SweepError(f'sweep file {path} line {e.lineno}: syntax error: {e.msg}') from None
  except Exception as e:  # noqa: BLE001
    raise SweepError(f'sweep file {path}: importing it raised {type(e).__name__}: {e}') from None
  for fn in ('get_config', 'get_sweep'):
    if not callable(getattr(module, fn, None)):
      raise SweepError(f'{path} must define {fn}()')
  return module


def get_sweep(module, arg=None):
  """`module.get_sweep(arg)`, or `get_sweep()` for files whose grid does not depend on the arg."""
  try:
    params = inspect.signature(module.get_sweep).parameters
  except (TypeError, ValueError):
    params = {}
  try:
    sweep = module.get_sweep(arg) if params else module.get_sweep()
  except Exception as e:  # noqa: BLE001
    raise SweepError(f'get_sweep() of {module.__file__} raised {type(e).__name__}: {e}') from None
  if not isinstance(sweep, dict):
    raise SweepError(f'get_sweep() of {module.__file__} returned {type(sweep).__name__}; valid: a '
                     f'dict with keys among {", ".join(SWEEP_KEYS)}')
  return sweep


def format_value(value):
  """The text of an override value, for a cell name and for `--config.FIELD=VALUE`."""
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float):
    return repr(value)  # shortest round-trip text: 0.002, 1e-05
  return str(value)


def cell_name(overrides, seed):
  """'field=value,...,seed=N' with fields sorted; filesystem-safe, at most MAX_NAME characters."""
  items = [f'{k}={format_value(v)}' for k, v in sorted(overrides.items())] + [f'seed={seed}']
  name = _UNSAFE.sub('_', ','.join(items))
  if len(name) > MAX_NAME:
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    name = f'{name[:MAX_NAME - 11]}~{digest}'
  return name


def parse_seeds(texts):
  """--seeds as integers (SweepError naming the first one that is not)."""
  out = []
  for text in texts:
    try:
      out.append(int(text))
    except (TypeError, ValueError):
      raise SweepError(f'--seeds={",".join(map(str, texts))}: {text!r} is not an integer; valid: '
                       'comma-separated integers, e.g. 0,1,2') from None
  return out


def expand(sweep, seeds=None):
  """Sweep dict -> list of cells {'name', 'overrides', 'seed', 'after'} (cells x grid x seeds, in
  order); 'after' names the cell whose parameters train.init_from starts from, or is None.

  Args:
    sweep: the dict `get_sweep()` returns.
    seeds: overrides the sweep's seeds (e.g. from `--seeds`).

  Raises:
    SweepError: on unknown keys, a `train.seed` override, or two cells with the same name.
  """
  _check_shape(sweep)
  grid = sweep.get('grid') or {}
  points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
  rungs = ladder_rungs(sweep)
  seeds = list(sweep.get('seeds') or [0]) if seeds is None else parse_seeds(seeds)
  cells, seen = [], {}
  for cell in sweep.get('cells') or [{}]:
    for point in points:
      overlap = set(cell) & set(point)
      if overlap:
        raise SweepError(f'fields {sorted(overlap)} are both in a cell and in the grid')
      for rung in rungs:
        overrides = {**cell, **point, **rung}
        _add_cells(cells, seen, overrides, seeds)
  return cells


def _add_cells(cells, seen, overrides, seeds):
  """Appends one cell per seed of `overrides` to `cells` (SweepError on a duplicate name)."""
  if 'train.seed' in overrides:
    raise SweepError("set seeds with the sweep's 'seeds' (or --seeds), not 'train.seed'")
  for seed in seeds:
    seeded, after = _resolve_sources(overrides, seed, seen)
    name = cell_name(seeded, seed)
    if name in seen:
      raise SweepError(f'two cells are both named {name}')
    seen[name] = True
    cells.append({'name': name, 'overrides': seeded, 'seed': seed, 'after': after})


def ladder_rungs(sweep):
  """The overrides of every (size, budget) of the sweep's 'ladder', sizes first: the size's
  fields and `ladder.flops`; [{}] without a ladder."""
  ladder = sweep.get('ladder')
  if not ladder:
    return [{}]
  return [{**size, BUDGET: float(flops)} for size in ladder_sizes(ladder).values()
          for flops in ladder['flops']]


def ladder_sizes(ladder):
  """{size name: overrides} of a ladder: its own names when 'sizes' is a dict, else each size's
  overrides as a cell name ('model.d_model=64,model.num_layers=4')."""
  sizes = ladder['sizes']
  if isinstance(sizes, dict):
    return dict(sizes)
  return {cell_name(size, 0).rsplit(',seed=', 1)[0]: size for size in sizes}


def _check_ladder(ladder):
  """Raises SweepError unless `ladder` is {'sizes': [non-empty dicts], 'flops': [positive
  numbers]}, the sizes naming the same fields."""
  if not isinstance(ladder, dict) or set(ladder) != {'sizes', 'flops'}:
    raise SweepError(f"'ladder' must be a dict with keys 'sizes' and 'flops'; got {ladder!r}")
  sizes, flops = ladder['sizes'], ladder['flops']
  if isinstance(sizes, dict):  # named sizes: {'small': {...}, 'large': {...}}
    sizes = list(sizes.values())
  if (not isinstance(sizes, (list, tuple)) or not sizes
      or not all(isinstance(s, dict) and s for s in sizes)):
    raise SweepError("ladder['sizes'] must be a non-empty list (or dict by name) of non-empty "
                     "dicts of overrides, e.g. [{'model.d_model': 64, 'model.num_layers': 4}]; "
                     f"got {ladder['sizes']!r}")
  if len({tuple(sorted(s)) for s in sizes}) > 1 or 'train.steps' in sizes[0]:
    raise SweepError(f"ladder['sizes'] must all set the same fields, none of them train.steps "
                     f"(the budget sets it); got {sizes!r}")
  if (not isinstance(flops, (list, tuple)) or not flops or any(
      isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0 for f in flops)):
    raise SweepError(f"ladder['flops'] must be a non-empty list of positive training-FLOP "
                     f"budgets, e.g. [1e12, 3e12]; got {flops!r}")


def _check_shape(sweep):
  """Raises SweepError on unknown keys, an empty grid field, cells that are not dicts, or an
  eval_variants or eval_flags selector that is not `field=value[,field=value]`."""
  unknown = set(sweep) - set(SWEEP_KEYS)
  if unknown:
    raise SweepError(f'unknown sweep keys {sorted(unknown)}; valid: {", ".join(SWEEP_KEYS)}')
  for field, values in (sweep.get('grid') or {}).items():
    if not isinstance(values, (list, tuple)) or not values:
      raise SweepError(f'grid[{field!r}] must be a non-empty list of values')
  cells = sweep.get('cells') or [{}]
  if not isinstance(cells, (list, tuple)) or not all(isinstance(c, dict) for c in cells):
    bad = next((c for c in cells if not isinstance(c, dict)), cells)
    raise SweepError(f"'cells' must be a list of dicts of overrides ({{'field': value}}); got "
                     f'{bad!r}')
  if 'ladder' in sweep:
    _check_ladder(sweep['ladder'])
    varied = set(sweep.get('grid') or {}).union(*cells)
    size_fields = set(next(iter(ladder_sizes(sweep['ladder']).values())))
    clash = varied & (size_fields | {'train.steps', BUDGET})
    if clash:
      raise SweepError(f'fields {sorted(clash)} are both in the ladder and in the cells or grid; '
                       'valid: a ladder sets its size fields and train.steps alone')
  flags = sweep.get('eval_flags')
  selectors = [('eval_variants', s) for s in sweep.get('eval_variants') or {}]
  if isinstance(flags, dict):  # per selected cells; '' selects every cell
    selectors += [('eval_flags', s) for s in flags if s != '']
  for key, selector in selectors:
    parts = [p for p in str(selector).split(',') if p.strip()]
    if not parts or any('=' not in p for p in parts):
      raise SweepError(f"{key} selector {selector!r} must be 'field=value[,field=value]'")


def _resolve_sources(overrides, seed, seen):
  """(overrides with train.init_from={'cell': {...}} replaced by that earlier cell's name without
  its seed, the earlier cell's full name or None)."""
  out, after = dict(overrides), None
  for field, value in overrides.items():
    if isinstance(value, dict):
      # Only train.init_from takes a dict, and only {'cell': overrides of an earlier cell}.
      after = cell_name(value.get('cell', {}), seed) if field == 'train.init_from' else None
      if after not in seen or set(value) != {'cell'}:
        raise SweepError(f"{field}={value!r}: valid dict values: train.init_from={{'cell': "
                         "{overrides of a cell listed before this one}}")
      out[field] = after.rsplit(',seed=', 1)[0]  # the same seed by construction: name it once
  return out, after


def base_config(module, arg):
  """The sweep file's `get_config(arg)`, the config every cell starts from (SweepError when it
  raises)."""
  try:
    return module.get_config(arg)
  except Exception as e:  # noqa: BLE001
    raise SweepError(f'get_config({arg!r}) of {module.__file__} raised {type(e).__name__}: '
                     f'{e}') from None


def cell_config(module, arg, cell):
  """The resolved, validated config of a cell (raises SweepError naming the field)."""
  config = base_config(module, arg)
  budget = cell['overrides'].get(BUDGET)
  for field, value in list(cell['overrides'].items()) + [('train.seed', cell['seed'])]:
    if field == BUDGET:
      continue
    *parents, leaf = field.split('.')
    node = config
    try:
      for p in parents:
        node = node[p]
      if leaf not in node:
        raise KeyError(leaf)
      node[leaf] = value
    except (KeyError, AttributeError):
      raise SweepError(f'cell {cell["name"]}: no config field {field!r}') from None
    except TypeError as e:
      raise SweepError(f'cell {cell["name"]}: {field}={value!r}: {e}') from None
  config = validation.resolve(config)
  try:
    if budget is not None:
      config.train.steps = matched_steps(config, budget)
    validation.validate(config)
  except options.ConfigError as e:
    raise SweepError(f'cell {cell["name"]}: {e}') from None
  return config


def tokens_per_step(config):
  """Tokens one training step trains on: train.batch_size rows of data.max_length."""
  return config.train.batch_size * config.data.max_length


def flops_per_token(config):
  """`models.accounting.training_flops_per_token` of a resolved config, V from its task."""
  vocab = state_lib.model_vocab_size(config, tools_accounting.task_vocab_size(config.data))
  return accounting.training_flops_per_token(config.model, vocab, config.data.max_length)


def matched_steps(config, budget):
  """The train.steps that spend `budget` training FLOPs on this config's own model (at least 1):
  round(budget / (FLOPs per token x batch x length)), within half a step of the budget."""
  if not accounting.covers(config.model.arch):
    raise options.ConfigError(f'{BUDGET}: model.arch={config.model.arch!r} has no FLOP count; '
                              'valid: a Transformer arch')
  return max(1, round(budget / (flops_per_token(config) * tokens_per_step(config))))


def train_command(spec, sweep_dir, cell, python='python', train_py='train.py'):
  """The train.py argv of a cell; a ladder cell's budget is passed as its matched train.steps
  (`cell['steps']`, set by the runner from `cell_config`)."""
  workdir = paths.join(sweep_dir, cell['name'])
  argv = [python, train_py, f'--config={spec}', f'--workdir={workdir}']
  for field, value in cell['overrides'].items():
    if field == BUDGET:
      if cell.get('steps') is None:
        raise SweepError(f'cell {cell["name"]}: no matched train.steps for its {BUDGET}; valid: '
                         'a cell whose config the runner resolved (sweep_spec.cell_config)')
      argv.append(f'--config.train.steps={cell["steps"]}')
      continue
    if field == 'train.init_from' and cell.get('after'):
      text = os.path.join(sweep_dir, cell['after'])  # the source cell's workdir
    else:
      text = format_value(value)
    argv.append(f'--config.{field}={text}')
  return argv + [f'--config.train.seed={cell["seed"]}']


def _selected(selector, cell):
  """Whether `field=value[,field=value]` matches the cell's overrides (and seed)."""
  items = {k: format_value(v) for k, v in cell['overrides'].items()}
  items['seed'] = str(cell['seed'])
  for part in filter(None, selector.split(',')):
    field, _, value = part.partition('=')
    if items.get(field.strip()) != value.strip():
      return False
  return True


def eval_commands(sweep, sweep_dir, cell, python='python', eval_py='eval.py'):
  """[(suffix, argv)] of a cell's eval.py runs: one per variant, then '' for eval_flags (last:
  the runner renames each variant's eval.json to eval_<suffix>.json; eval.json stays the plain)."""
  workdir = paths.join(sweep_dir, cell['name'])
  flags = sweep.get('eval_flags') or []
  if isinstance(flags, dict):  # {selector: flags}: the flags of every selector the cell matches
    flags = [f for selector, some in flags.items() if _selected(selector, cell) for f in some]
  base = [python, eval_py, f'--workdir={workdir}'] + list(flags)
  runs = []
  for selector, variants in (sweep.get('eval_variants') or {}).items():
    if _selected(selector, cell):
      runs += [(_UNSAFE.sub('_', flag.lstrip('-')), base + [flag]) for flag in variants]
  if 'eval_flags' in sweep:
    runs.append(('', base))
  return runs
