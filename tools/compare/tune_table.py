"""tools.compare on a tuned sweep (`tools.sweep --tune`, tools/sweep/tune.py): each cell is compared
at its own chosen value, and the tuning runs at the other values get a table of their own.

`split_runs` reads the choice file (tune.json) of every sweep directory compared. A cell's runs at
its chosen value stay in the comparison, marked `run['tuned'] = {field: value}`: tools.compare.runs
then leaves the tuned field out of the groups and labels (when every run compared is tuned on it)
and the summary table shows it as a column (`chosen learning_rate`). Its tuning runs at the other
values, and all of its tuning runs while it has chosen nothing, are set aside. `markdown`
tabulates the tuning runs: cell x value -> final validation loss, the chosen value in bold.
"""

from training import paths as paths_lib  # local or gs://
from tools.compare import extrapolation as extrapolation_compare
from tools.compare import runs as runs_lib
from tools.sweep import spec as sweep_spec
from tools.sweep import tune as sweep_tune


def read_choices(paths):
  """[(sweep directory, its choice file as a dict)] of the directories among `paths` that have
  one."""
  choices = []
  for path in paths:
    if runs_lib.is_workdir(path) or not paths_lib.isdir(path):
      continue
    doc = sweep_tune.read_choices(path)
    if doc:
      choices.append((path, doc))
  return choices


def split_runs(runs, choices):
  """The runs to compare: those at a tuned cell's chosen value (marked `run['tuned']`) and those of
  no tuned cell, without the other tuning runs (`markdown` shows those).
  All runs when no cell has chosen
  yet (the tuning runs are then all there is to compare)."""
  chosen, aside = {}, set()
  for path, doc in choices:
    for entry in doc.get('cells', []):
      for name in entry.get('runs') or []:
        chosen[paths_lib.join(path, name)] = {doc['field']: entry['chosen']}
  for path, doc in choices:
    for entry in doc.get('cells', []):
      aside.update(paths_lib.join(path, t['run']) for t in entry.get('tuning', []))
  aside -= set(chosen)
  kept = []
  for run in runs:
    if run['workdir'] in chosen:
      run['tuned'] = chosen[run['workdir']]
      kept.append(run)
    elif run['workdir'] not in aside:
      kept.append(run)
  return kept if any(run.get('tuned') for run in kept) else runs


def markdown(choices, groups):
  """The tuning table of each choice file (cells named as in the summary table, when their runs
  are compared), or '' without choice files."""
  labels = {run['workdir']: label for label, runs in groups for run in runs}
  tables = []
  for path, doc in choices:
    tables.append(_table(path, doc, labels))
    tables.append(_extrapolation_table(path, doc, labels))
  return '\n\n'.join(table for table in tables if table)


def _table(path, doc, labels):
  field, values = doc['field'], doc['values']
  head = ['cell'] + [sweep_spec.format_value(v) for v in values] + ['chosen']
  lines = [f'Tuning of {field} ({paths_lib.join(path, sweep_tune.CHOICE_FILE)}): the final '
           f'validation loss of each cell\'s seed {doc.get("tuning_seed")} at every value; the '
           'chosen value (bold) has the lowest among the runs that finished; "(edge)": the '
           'smallest or largest value of the grid, so one beyond it may do better.', '',
           _line(head), '|' + '---|' * len(head)]
  for entry in doc.get('cells', []):
    cells = [_cell_label(path, entry, labels)]
    for run in entry.get('tuning', []):
      text = _loss_text(run)
      cells.append(f'**{text}**' if run['value'] == entry.get('chosen') else text)
    cells.append(_chosen_text(entry, values))
    lines.append(_line(cells))
  return '\n'.join(lines)


def _extrapolation_table(path, doc, labels):
  """Cell x value -> 'r2 / r4 / r8' of each tuning run's eval.json, or '' when no tuning run has
  extrapolation rows."""
  ratios = [f'r{k}' for k in extrapolation_compare.RATIOS]
  rows, found = [], False
  for entry in doc.get('cells', []):
    cells = [_cell_label(path, entry, labels)]
    for run in entry.get('tuning', []):
      result = extrapolation_compare.load_eval(paths_lib.join(path, run['run']))
      metrics = extrapolation_compare.run_metrics(result)
      if metrics['loss_L'] is None:
        cells.append('-')
        continue
      found = True
      text = ' / '.join('-' if metrics[r] is None else f'{metrics[r]:.2f}' for r in ratios)
      cells.append(f'**{text}**' if run['value'] == entry.get('chosen') else text)
    rows.append(_line(cells))
  if not found:
    return ''
  head = ['cell'] + [sweep_spec.format_value(v) for v in doc['values']]
  return '\n'.join([f'Extrapolation of the same tuning runs at every value of {doc["field"]}: '
                    f'{" / ".join(ratios)} (loss at kL over the loss at L, '
                    f'{extrapolation_compare.MODE} windows); the chosen value in bold.', '',
                    _line(head), '|' + '---|' * len(head)] + rows)


def _cell_label(path, entry, labels):
  """The cell's label in the summary table, or its overrides when its runs are not compared."""
  workdirs = [paths_lib.join(path, name) for name in entry.get('runs') or []]
  return next((labels[w] for w in workdirs if w in labels), entry.get('cell') or '(base)')


def _loss_text(run):
  """A tuning run's cell: its final validation loss, 'diverged', 'unfinished' or '-' (not ended
  when the cell last chose)."""
  status, loss = run.get('status'), run.get('valid_loss')
  if status == 'diverged':
    return 'diverged'
  if status == 'done' and loss is not None:
    return f'{loss:.4f}'
  return '-' if status is None else 'unfinished'


def _chosen_text(entry, values):
  if entry.get('chosen') is not None:
    edge = ' (edge)' if sweep_tune.grid_edge(values, entry['chosen']) else ''
    return sweep_spec.format_value(entry['chosen']) + edge
  return f'none: {entry["note"]}' if entry.get('note') else 'not yet'


def _line(cells):
  return '| ' + ' | '.join(cells) + ' |'
