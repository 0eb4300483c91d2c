"""The comparison's markdown table: one row per group of runs, and a footnote defining its flags."""

import math

import numpy as np

from tools.compare import summary as summary_lib


def markdown_table(summary, target_loss=None, target_split='valid'):
  """The summary (`tools.compare.summary.summarize`) as a markdown table, with a footnote defining
  the flags."""
  has_init = any(v is not None for row in summary for v in row['init_grad_ratio'])
  tuned = sorted({f for row in summary for f in row.get('tuned') or ()})
  head = _header(target_loss, target_split, has_init, tuned)
  tested = any(row.get('verdict') for row in summary)  # tools.compare --baseline
  verdict_at = head.index('best valid')  # the verdict follows the value it judges
  if tested:
    head.insert(verdict_at, 'final valid vs baseline')
  lines = [_line(head), '|' + '---|' * len(head)]
  for row in summary:
    cells = _cells(row, target_loss, has_init, tuned)
    if tested:
      cells.insert(verdict_at, row.get('verdict') or '-')
    lines.append(_line(cells))
  lines += ['', _footnote(has_init, tuned)]
  return '\n'.join(lines)


def _line(cells):
  return '| ' + ' | '.join(cells) + ' |'


def _header(target_loss, target_split, has_init, tuned):
  head = ['cell', 'seeds']
  if tuned:  # the fields of a tuned sweep (tools.sweep --tune): usually one
    head.append(f'chosen {tuned[0].split(".")[-1]}' if len(tuned) == 1 else 'chosen')
  head += ['final train', 'final valid', 'best valid']
  if target_loss is not None:
    head.append(f'steps to {target_split} <= {target_loss:g}')
  if has_init:
    head.append('init grad first/last block')
  return head + ['tokens/s', 'params', 'flags']


def _cells(row, target_loss, has_init, tuned):
  """One group's cells, in the order of `_header`."""
  cells = [row['label'], str(row['seeds'])]
  if tuned:
    cells.append(_chosen(row.get('tuned'), tuned))
  cells += [_stat(row['final_train']), _stat(row['final_valid']), _stat(row['best_valid'])]
  if target_loss is not None:
    cells.append(_reached(row))
  if has_init:
    cells.append(_stat(row['init_grad_ratio'], '{:.3g}'))
  cells.append(_stat(row['tokens_per_sec'], '{:.0f}'))
  cells.append(f'{row["num_params"]:,}' if row['num_params'] else '-')
  cells.append(', '.join(_flags(row)) or 'ok')
  return cells


def _stat(values, fmt='{:.4f}'):
  """'m' for one value, 'mean [min, max]' for several, '-' for none."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  if not values:
    return '-'
  if len(values) == 1:
    return fmt.format(values[0])
  return f'{fmt.format(np.mean(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]'


def _chosen(values, tuned):
  """The value a tuned sweep chose for the group ('field=value' when several fields were tuned),
  '-' for a group of no tuned sweep."""
  if not values:
    return '-'
  if len(tuned) == 1:
    return _value(values.get(tuned[0]))
  return ', '.join(f'{f.split(".")[-1]}={_value(v)}' for f, v in sorted(values.items()))


def _value(value):
  return repr(value) if isinstance(value, float) else str(value)


def _reached(row):
  """The steps to the target loss of the seeds that reached it, and how many did."""
  reached = [s for s in row['steps_to_target'] if s is not None]
  if not reached:
    return f'never (0/{row["seeds"]})'
  return f'{_stat(reached, "{:.0f}")} ({len(reached)}/{row["seeds"]})'


def _flags(row):
  """['DIVERGED 1/3 (step 70)', 'PLATEAU 2/3', 'incomplete 1/3'], the flags any seed raised."""
  seeds = row['seeds']
  flags = []
  diverged = [step for step in row['diverged'] if step is not None]
  if diverged:
    flags.append(f'DIVERGED {len(diverged)}/{seeds} (step {min(diverged)})')
  if any(row['plateaued']):
    flags.append(f'PLATEAU {sum(row["plateaued"])}/{seeds}')
  if row['incomplete']:
    flags.append(f'incomplete {row["incomplete"]}/{seeds}')
  return flags


def _footnote(has_init, tuned):
  init = ''
  if has_init:
    init = ("init grad first/last block: the first block's gradient norm at initialisation over "
            "the last block's. ")
  if tuned:
    init += (f'chosen: the value of {", ".join(tuned)} the cell\'s seeds trained at, the one whose '
             'tuning run had the lowest final validation loss (the tuning table). ')
  return (f'Mean [min, max] across seeds; final train: the last logged training loss. {init}'
          f'DIVERGED: a non-finite loss, or a train loss above '
          f'{summary_lib.SPIKE_FACTOR:g}x its running minimum after '
          f'{summary_lib.SPIKE_AFTER:.0%} of the steps. '
          f'PLATEAU: the final train loss within {summary_lib.PLATEAU_TOLERANCE:.0%} of the loss '
          f'at {summary_lib.PLATEAU_AT:.0%} of the steps and above '
          f'{summary_lib.PLATEAU_LEVEL:g}x the unigram entropy.')
