"""A sweep's compute-matched ladder: every cell's size, budget and steps, as a table and an index.

The ladder's format and the matched steps are documented in tools/sweep/__main__.py and
`tools.sweep.spec.matched_steps`; tools.compare reads the index (`INDEX`) to draw the frontier.
"""

import json

from models import accounting
from training import paths
from training import state as state_lib
from tools import accounting as tools_accounting
from tools.sweep import spec as sweep_spec

INDEX = 'ladder.json'  # in the sweep dir: {cell name without seed: its variant, size and budget}
# The dry run's time estimate: a stated sustained rate for this 2-core CPU host, float32 with XLA
# (about a tenth of its peak); a run elsewhere scales by its own rate.
HOST_FLOPS = 2e10
TOKENS_PER_PARAM = (1, 1000)  # outside: one warning line (Chinchilla's optimum is about 20)


def is_ladder(cell):
  """Whether the cell is a rung of a ladder (its overrides carry the budget)."""
  return sweep_spec.BUDGET in cell['overrides']


def split(cell, size_fields):
  """(variant overrides, size overrides, budget) of a ladder cell."""
  overrides = cell['overrides']
  size = {k: v for k, v in overrides.items() if k in size_fields}
  variant = {k: v for k, v in overrides.items()
             if k not in size_fields and k != sweep_spec.BUDGET}
  return variant, size, overrides[sweep_spec.BUDGET]


def index(sweep, cells):
  """{cell name without its seed: {'variant' (its overrides as a cell name without the seed, ''
  for none), 'size' (`spec.ladder_sizes`' name), 'flops'}} of the ladder's cells."""
  names = {sweep_spec.cell_name(o, 0): name
           for name, o in sweep_spec.ladder_sizes(sweep['ladder']).items()}
  size_fields = set(next(iter(sweep_spec.ladder_sizes(sweep['ladder']).values())))
  out = {}
  for cell in cells:
    if is_ladder(cell):
      variant, size, budget = split(cell, size_fields)
      out[cell['name'].rsplit(',seed=', 1)[0]] = {
          'variant': _label(variant), 'size': names[sweep_spec.cell_name(size, 0)],
          'flops': budget}
  return out


def _label(overrides):
  return sweep_spec.cell_name(overrides, 0).rsplit(',seed=', 1)[0].removesuffix('seed=0')


def write_index(sweep_dir, sweep, cells):
  """Writes `INDEX` in the sweep dir (nothing for a sweep without a ladder); returns its path."""
  if not sweep.get('ladder'):
    return None
  path = paths.join(sweep_dir, INDEX)
  paths.write_text(path, json.dumps(index(sweep, cells), indent=2, sort_keys=True))
  return path


def row(config, cell):
  """One dry-run row of a ladder cell's resolved config: {'cell', 'params', 'tokens',
  'tokens_per_param', 'steps', 'flops', 'seconds'}; params are those a token passes through
  (`accounting.active_params`: an MoE's active ones), the embedding included."""
  vocab = state_lib.model_vocab_size(config, tools_accounting.task_vocab_size(config.data))
  params = accounting.active_params(config.model, vocab, config.data.max_length)
  tokens = config.train.steps * sweep_spec.tokens_per_step(config)
  flops = tokens * sweep_spec.flops_per_token(config)
  return {'cell': cell['name'], 'params': params, 'tokens': tokens,
          'tokens_per_param': tokens / params, 'steps': config.train.steps, 'flops': flops,
          'seconds': flops / HOST_FLOPS}


def table(rows):
  """The dry run's markdown table of `row`s, then one warning line per cell whose tokens per
  parameter fall outside TOKENS_PER_PARAM."""
  lines = ['| cell | parameters | tokens | tokens/param | steps | train FLOPs | est. time here |',
           '|---|---:|---:|---:|---:|---:|---:|']
  for r in rows:
    lines.append(f'| {r["cell"]} | {r["params"]:,} | {r["tokens"]:,} | '
                 f'{r["tokens_per_param"]:.3g} | {r["steps"]} | {r["flops"]:.3g} | '
                 f'{_duration(r["seconds"])} |')
  lines.append(f'(time at an assumed {HOST_FLOPS:.0e} FLOP/s, this CPU host\'s sustained rate)')
  low, high = TOKENS_PER_PARAM
  for r in rows:
    if not low <= r['tokens_per_param'] <= high:
      lines.append(f'warning: {r["cell"]}: {r["tokens_per_param"]:.3g} tokens per parameter, '
                   f'outside [{low}, {high}]: a budget too small or too large for this size')
  return '\n'.join(lines)


def _duration(seconds):
  if seconds < 120:
    return f'{seconds:.0f}s'
  return f'{seconds / 60:.0f}min' if seconds < 7200 else f'{seconds / 3600:.1f}h'
