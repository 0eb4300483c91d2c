"""A sweep's tuning axis (`tools.sweep --tune=FIELD:V1,V2,...`): every cell trains at each value
with the first seed, keeps the value with the lowest final validation loss, and trains its other
seeds at that value only.

Ablations compare variants fairly only at each variant's own best learning rate: a change of
attention or positions can move the best rate, and at one shared rate a variant may look no
better than the baseline although it is at its own. With `--tune=train.learning_rate:5e-4,1e-3,2e-3`
each cell of the sweep trains once per rate at the first seed: its tuning runs, ordinary cells
named `model.norm_position=post,train.learning_rate=0.0005,seed=0` (skipped when finished,
resumed when interrupted). Once all of a cell's tuning runs have ended, `choose` picks its value,
and the cell's other seeds train at that value (`cell_name(overrides + {FIELD: chosen}, seed)`);
other cells run meanwhile.

The rule (`RULE`): among the tuning runs that finished, the smallest value whose validation loss
at the last step (the final evaluation: train.py always evaluates at its last step) is within the
tolerance (`--tune_tolerance`, default `TOLERANCE` nats) of the lowest; for values that are not
numbers, the first listed within it. A run that diverged or did not finish is never chosen. On a
flat signal the lowest loss is noise among the top values: one seed's final loss moves by about
the seed spread (0.003 nats on the toy stream at one rate), so a gap smaller than that does not
say which value is better, and the smallest such value (for a learning rate, the most
conservative) is taken. With tolerance 0 it is the plain lowest loss, ties to the value listed
first. The final loss rather than the
best over evaluations: it is the loss of the model the run ends with, and the lowest of several
noisy evaluations favours the noisiest (highest) rates. A cell whose tuning runs did not all end
(failed, stopped) or where none finished with a finite loss chooses nothing: its other seeds are
not started.

The choices go to SWEEP_DIR/tune.json (`CHOICE_FILE`), rewritten whole as each cell chooses:

    {"field": "train.learning_rate", "values": [0.0005, 0.001, 0.002], "tuning_seed": 0,
     "seeds": [0, 1, 2], "rule": "...",
     "cells": [{"cell": "model.norm_position=post", "overrides": {"model.norm_position": "post"},
                "tuning": [{"value": 0.0005, "run": "<workdir name>", "status": "done",
                            "valid_loss": 2.31}, ...],
                "chosen": 0.001, "runs": ["<workdir name at the chosen value, per seed>", ...],
                "note": ""}]}

`chosen` is null (and `runs` empty) until the cell's tuning runs have ended, or when nothing could
be chosen (`note` says why). tools.compare reads it (tools/compare/tune_table.py).
"""

import math
from typing import NamedTuple

from training import paths
from tools.sweep import cells as sweep_cells
from tools.sweep import spec as sweep_spec
from tools.sweep.spec import SweepError

CHOICE_FILE = 'tune.json'
TOLERANCE = 0.003  # nats: the seed spread of the final validation loss at one rate (toy stream)
RULE = ("among the tuning seed's runs that finished, the smallest value whose validation loss at "
        'the last step (the final evaluation) is within the tolerance of the lowest (values that '
        'are not numbers: the first listed within it); a run that diverged or did not finish is '
        'never chosen')
ENDED = ('done', 'skipped', 'diverged')  # results of a tuning run that leave a choice to make
_FORM = 'valid: FIELD:V1,V2,..., e.g. --tune=train.learning_rate:5e-4,1e-3,2e-3'


class Axis(NamedTuple):
  """The tuned config field, its values (typed as the field is) and the choice's tolerance."""
  field: str
  values: list
  tolerance: float = TOLERANCE


# --- The flag -------------------------------------------------------------------------------------

def parse(text, module, arg, sweep, tolerance=TOLERANCE):
  """`--tune=FIELD:V1,V2,...` -> Axis, checked against the sweep file's config and cells.

  Raises:
    SweepError: (one line) on a malformed flag, an empty value list, a field the config lacks, a
      field the sweep file already sets, `train.seed`, a value that is not of the field's type,
      or a value listed twice; a tolerance that is not a finite number >= 0.
  """
  flag = f'--tune={text}'
  if not isinstance(tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0:
    raise SweepError(f'--tune_tolerance={tolerance!r} must be a number >= 0 (nats of final '
                     f'validation loss; 0 = the plain lowest), e.g. {TOLERANCE}')
  field, sep, rest = text.partition(':')
  field = field.strip()
  if not field:
    raise SweepError(f'{flag}: no config field; {_FORM}')
  texts = [t.strip() for t in rest.split(',')]
  if not sep or not rest.strip():
    raise SweepError(f'{flag}: no values to try; {_FORM}')
  if not all(texts):
    raise SweepError(f'{flag}: an empty value in the list; {_FORM}')
  if field == 'train.seed':
    raise SweepError(f'{flag}: seeds are set with --seeds (or the sweep\'s seeds), not tuned')
  where = _swept_in(field, sweep)
  if where:
    raise SweepError(f'{flag}: the sweep file already sets {field} (in its {where}); tune a field '
                     'the sweep does not set, or remove it from the sweep file')
  current = _current_value(module, arg, field, flag)
  values = [_convert(t, current, field, flag) for t in texts]
  if len(set(map(repr, values))) < len(values):
    raise SweepError(f'{flag}: a value is listed twice')
  return Axis(field, values, float(tolerance))


def _swept_in(field, sweep):
  """'grid' or 'cells' when the sweep file sets `field` there, else ''."""
  if field in (sweep.get('grid') or {}):
    return 'grid'
  if any(field in cell for cell in sweep.get('cells') or [] if isinstance(cell, dict)):
    return 'cells'
  return ''


def _current_value(module, arg, field, flag):
  """The field's value in the sweep file's base config (SweepError when it has no such field)."""
  node = sweep_spec.base_config(module, arg)
  for part in field.split('.'):
    try:
      if part not in node:
        raise KeyError(part)
      node = node[part]
    except (KeyError, TypeError, AttributeError):
      raise SweepError(f'{flag}: no config field {field!r}') from None
  if hasattr(node, 'keys'):
    raise SweepError(f'{flag}: {field} is a section of the config; valid: one of its fields, e.g. '
                     f'{field}.{sorted(node.keys())[0]}')
  return node


def _convert(text, current, field, flag):
  """`text` as a value of the field's type (bool, int, float or str)."""
  if isinstance(current, bool):
    if text.lower() not in ('true', 'false'):
      raise SweepError(f'{flag}: {text!r} is not true or false ({field} is a bool)')
    return text.lower() == 'true'
  kinds = ((int, 'an integer'), (float, 'a number'), (str, 'a string'))
  for kind, words in kinds:
    if isinstance(current, kind):
      try:
        return kind(text)
      except ValueError:
        raise SweepError(f'{flag}: {text!r} is not {words} ({field} is {words})') from None
  raise SweepError(f'{flag}: {field} holds a {type(current).__name__}; valid: a field holding a '
                   'number, a string or a bool')


# --- The plan -------------------------------------------------------------------------------------

def cell_label(overrides):
  """A cell's overrides as its run names list them, without the tuned field and the seed."""
  return ','.join(f'{k}={sweep_spec.format_value(v)}' for k, v in sorted(overrides.items()))


class CellTuning:
  """One cell of the sweep under tuning: its tuning runs, its other seeds, and its choice."""

  def __init__(self, axis, overrides, seeds):
    self.axis, self.overrides, self.seeds = axis, overrides, seeds
    self.label = cell_label(overrides)
    self.runs = [sweep_spec.cell_name(self._at(v), seeds[0]) for v in axis.values]
    self.records = [{'status': None, 'valid_loss': None} for _ in self.runs]
    self.chosen, self.note, self.decided = None, '', False

  def _at(self, value):
    return {**self.overrides, self.axis.field: value}

  def tuning_cells(self):
    """The cells of the tuning runs: every value at the first seed."""
    return [{'name': name, 'overrides': self._at(value), 'seed': self.seeds[0], 'after': None}
            for name, value in zip(self.runs, self.axis.values)]

  def seed_cells(self):
    """Placeholders of the other seeds (their value is not known yet): `resolve` makes them
    cells once the tuning runs have ended."""
    placeholder = {**self.overrides, self.axis.field: 'tuned'}
    return [{'name': sweep_spec.cell_name(placeholder, seed), 'overrides': dict(self.overrides),
             'seed': seed, 'after': None, 'tuning': self} for seed in self.seeds[1:]]

  def chosen_runs(self):
    """The workdir names of the cell's runs at the chosen value, one per seed ([] until then)."""
    if self.chosen is None:
      return []
    return [sweep_spec.cell_name(self._at(self.chosen), seed) for seed in self.seeds]

  def decide(self, results, sweep_dir, steps):
    """Records each tuning run's status and final validation loss and chooses by `RULE`, once
    every tuning run has a result (`results`: run name -> the runner's result)."""
    for i, name in enumerate(self.runs):
      self.records[i] = read_record(paths.join(sweep_dir, name), steps[name])
    self.decided = True
    unended = [(n, results[n]) for n in self.runs if results[n] not in ENDED]
    if unended:
      self.note = f'tuning run {unended[0][0]}: {unended[0][1]}'
      return
    best = choose(self.records, self.axis.values, self.axis.tolerance)
    if best is None:
      self.note = 'no tuning run finished with a finite validation loss'
      return
    self.chosen, self.note = self.axis.values[best], ''

  def resolve(self, cell):
    """(the cell of seed `cell['seed']` at the chosen value, None), or (cell, why it cannot run)."""
    if self.chosen is None:
      return cell, f'no {self.axis.field} chosen: {self.note}'
    seed = cell['seed']
    overrides = self._at(self.chosen)
    return {'name': sweep_spec.cell_name(overrides, seed), 'overrides': overrides, 'seed': seed,
            'after': None}, None

  def resolve_on_disk(self, cell, sweep_dir, steps):
    """`resolve` for --dry_run: chooses from the tuning runs' workdirs when all have ended there."""
    if not self.decided:
      statuses = [read_record(paths.join(sweep_dir, n), steps[n])['status'] for n in self.runs]
      if not all(s in ('done', 'diverged') for s in statuses):
        return cell, f'waits for its tuning runs, then trains at the {self.axis.field} they choose'
      self.decide(dict(zip(self.runs, statuses)), sweep_dir, steps)
    return self.resolve(cell)

  def entry(self):
    """The cell's entry in the choice file."""
    tuning = [{'value': v, 'run': n, **r} for v, n, r in zip(self.axis.values, self.runs,
                                                           self.records)]
    return {'cell': self.label, 'overrides': self.overrides, 'tuning': tuning,
            'chosen': self.chosen, 'runs': self.chosen_runs(), 'note': self.note}

  def summary(self):
    """One progress line: the choice and every value's loss."""
    losses = ', '.join(f'{sweep_spec.format_value(v)}: {_loss_text(r)}'
                       for v, r in zip(self.axis.values, self.records))
    what = (f'{self.axis.field}={sweep_spec.format_value(self.chosen)}' if self.chosen is not None
            else f'nothing chosen ({self.note})')
    edge = grid_edge(self.axis.values, self.chosen)
    warn = f' ({edge} value of the grid: one beyond it may do better)' if edge else ''
    return f'tune: {self.label or "(the base config)"}: {what}{warn}; final valid loss {losses}'


def grid_edge(values, chosen):
  """'the smallest' or 'the largest' where `chosen` is that end of a numeric grid of three or more
  values (the best may then lie beyond the grid), else None."""
  numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
  if chosen is None or not numeric or len(values) < 3:
    return None
  if chosen == min(values):
    return 'the smallest'
  return 'the largest' if chosen == max(values) else None


def _loss_text(record):
  """A tuning run's final validation loss, or what kept it from having one."""
  if record['status'] == 'done' and record['valid_loss'] is not None:
    return f'{record["valid_loss"]:.4f}'
  return 'diverged' if record['status'] == 'diverged' else 'unfinished'


def plan(cells, axis):
  """expand()'s cells -> (the cells to run, [CellTuning]): per cell of the sweep, its tuning runs,
  then placeholders of its other seeds (`CellTuning.seed_cells`), in the sweep's order.

  Raises:
    SweepError: when a cell starts from another's parameters (train.init_from): its source's
      value would not be known when it is named.
  """
  if any(cell.get('after') for cell in cells):
    raise SweepError(f'--tune={axis.field}:...: this sweep starts cells from other cells\' '
                     'parameters (train.init_from); --tune does not combine with that')
  tunings = {}
  for cell in cells:
    key = cell_label(cell['overrides'])
    if key not in tunings:
      seeds = [c['seed'] for c in cells if c['overrides'] == cell['overrides']]
      tunings[key] = CellTuning(axis, dict(cell['overrides']), seeds)
  out = []
  for tuning in tunings.values():
    out += tuning.tuning_cells() + tuning.seed_cells()
  return out, list(tunings.values())


# --- The rule -------------------------------------------------------------------------------------

def read_record(workdir, steps):
  """{'status': done | diverged | partial | new, 'valid_loss': the last validation loss or None}."""
  status, _ = sweep_cells.cell_status(workdir, steps)
  _, valid = sweep_cells.final_losses(workdir)
  return {'status': status, 'valid_loss': valid}


def choose(records, values=None, tolerance=0.0):
  """The index of the chosen record by `RULE` ([{'status', 'valid_loss'}] in the order of
  `values`), or None when no run finished with a finite validation loss."""
  best = None
  for i, r in enumerate(records):
    loss = r.get('valid_loss')
    if r.get('status') != 'done' or loss is None or not math.isfinite(loss):
      continue
    if best is None or loss < records[best]['valid_loss']:
      best = i
  if best is None or not tolerance:
    return best
  near = [i for i, r in enumerate(records) if r.get('status') == 'done'
          and r.get('valid_loss') is not None and math.isfinite(r['valid_loss'])
          and r['valid_loss'] <= records[best]['valid_loss'] + tolerance]
  numeric = values is not None and all(
      isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
  return min(near, key=lambda i: values[i]) if numeric else near[0]


# --- The choice file ------------------------------------------------------------------------------

def read_choices(sweep_dir):
  """The sweep's choice file as a dict, or None when it has none."""
  path = paths.join(sweep_dir, CHOICE_FILE)
  if not paths.exists(path):
    return None
  try:
    return paths.read_json(path)
  except ValueError as e:  # json.JSONDecodeError
    raise ValueError(f'{path} is not valid JSON ({e}); remove it and rerun the sweep to write it '
                     'again') from None


class ChoiceFile:
  """SWEEP_DIR/tune.json, written whole at the start and after each cell's choice. Entries of an
  earlier run of the same axis are kept until their cell chooses again (a rerun stopped early
  leaves them as they were)."""

  def __init__(self, sweep_dir, axis, tunings):
    self.path = paths.join(sweep_dir, CHOICE_FILE)
    self.axis, self.tunings = axis, tunings
    self.head = {'field': axis.field, 'values': axis.values, 'tolerance': axis.tolerance,
                 'tuning_seed': tunings[0].seeds[0] if tunings else None,
                 'seeds': tunings[0].seeds if tunings else [], 'rule': RULE}
    old = read_choices(sweep_dir) or {}
    same = all(old.get(k) == v for k, v in self.head.items() if k != 'rule')
    self.kept = {e.get('cell'): e for e in old.get('cells', [])} if same else {}

  def write(self):
    cells = [t.entry() if t.decided else self.kept.get(t.label, t.entry()) for t in self.tunings]
    paths.write_json(self.path, {**self.head, 'cells': cells})


class Tuner:
  """The runner's side of tuning: as the last tuning run of a cell ends, the cell chooses, the
  choice file is rewritten and one line printed."""

  def __init__(self, sweep_dir, axis, tunings, steps, out):
    self.sweep_dir, self.steps, self.out = sweep_dir, steps, out
    self.by_run = {name: t for t in tunings for name in t.runs}
    self.file = ChoiceFile(sweep_dir, axis, tunings)

  def start(self):
    self.file.write()

  def ended(self, cell, results):
    """Called after each cell ends (`results`: every ended cell's result so far)."""
    tuning = self.by_run.get(cell['name'])
    if tuning is None or tuning.decided or not all(n in results for n in tuning.runs):
      return
    tuning.decide(results, self.sweep_dir, self.steps)
    self.file.write()
    print(tuning.summary(), file=self.out, flush=True)
