"""Compared runs grouped across seeds, and each group's numbers and flags (diverged, plateaued).

The flags are defined in tools/compare/__main__.py's docstring (the CLI's help) and in the
footnote of the table (tools/compare/summary_table.py).
"""

import json
import math

import numpy as np

from training import paths as paths_lib  # local or gs://
from tools.compare import runs as runs_lib

SPIKE_FACTOR = 2.0  # diverged: train loss > this x the running minimum ...
SPIKE_AFTER = 0.10  # ... after this share of the steps
PLATEAU_AT = 0.25  # plateaued: final loss compared with the loss at this share of the steps ...
PLATEAU_TOLERANCE = 0.05  # ... improved by less than this share ...
PLATEAU_LEVEL = 0.9  # ... and above this x the unigram entropy


# --- Flags of one run -----------------------------------------------------------------------------

def divergence(steps, losses, total):
  """The first step at which the run diverged (see tools/compare/__main__.py's docstring), or
  None."""
  running_min = math.inf
  for step, loss in zip(steps, losses):
    if not math.isfinite(loss):
      return int(step)
    if step > SPIKE_AFTER * total and loss > SPIKE_FACTOR * running_min:
      return int(step)
    running_min = min(running_min, loss)
  return None


def plateaued(steps, losses, total, level):
  """Whether a run plateaued (tools/compare/__main__.py's docstring); `level` the unigram entropy
  or None."""
  if len(losses) < 2 or not np.all(np.isfinite(losses)):
    return False
  if level is None:
    level = 0.5 * losses[0] / PLATEAU_LEVEL
  at = np.searchsorted(steps, PLATEAU_AT * total, side='left').clip(0, len(losses) - 1)
  reference, final = losses[at], losses[-1]
  return bool(final >= (1.0 - PLATEAU_TOLERANCE) * reference and final > PLATEAU_LEVEL * level)


def steps_to_target(steps, losses, target):
  """The first logged step whose loss is <= target, or None."""
  hit = np.nonzero(np.isfinite(losses) & (losses <= target))[0]
  return int(steps[hit[0]]) if len(hit) else None


# --- Groups ---------------------------------------------------------------------------------------

def group_runs(runs):
  """[(label, [runs])]: runs whose configs differ only in tools.compare.runs.IGNORED_FIELDS share a
  group.

  The label lists the fields that differ between groups (`norm_position=post,warmup_steps=0`,
  section prefixes dropped where unambiguous); a single group is labelled by its directory. It is
  the markdown table's cell name; the legend uses `tools.compare.legend.legend_labels`.
  """
  differing = runs_lib.differing_fields(runs)
  short = _short_names(differing)
  groups = {}
  for run in runs:
    groups.setdefault(_signature(run, differing), []).append(run)
  return [(_label(members, differing, short, len(groups)), members)
          for members in groups.values()]


def _short_names(fields):
  """Each field by its last part ('model.norm_position' -> 'norm_position'); every field in full
  when two would read the same."""
  short = {field: field.split('.')[-1] for field in fields}
  if len(set(short.values())) < len(short):
    return {field: field for field in fields}
  return short


def _signature(run, fields):
  """The key of a run's group: its values of `fields`; a run without config.json is alone."""
  if not run['config']:
    return ('dir', run['workdir'])
  return tuple(json.dumps(run['config'].get(field), sort_keys=True) for field in fields)


def _label(members, fields, short, num_groups):
  """A group's name: its values of the differing fields, else its runs' or their directory's."""
  first = members[0]
  if fields and first['config']:
    return ','.join(f'{short[field]}={_fmt(first["config"].get(field))}' for field in fields)
  if num_groups > 1:
    return first['name'].split(',seed=')[0]
  # The only group: named by the directory that holds its runs (a sweep's).
  return paths_lib.basename(paths_lib.dirname(first['workdir'])) or first['name']


def _fmt(value):
  return repr(value) if isinstance(value, float) else str(value)


# --- The numbers of each group --------------------------------------------------------------------

def summarize(groups, target_loss=None, target_split='valid'):
  """Per group: the table's numbers and flags. Returns a list of dicts (one per group)."""
  if target_split not in ('train', 'valid'):
    raise ValueError(f'--target_split: {target_split!r} unknown; valid: train, valid')
  if target_loss is not None and not math.isfinite(target_loss):
    raise ValueError(f'--target_loss={target_loss} must be a finite loss, e.g. 2.0')
  summary = []
  for label, runs in groups:
    row = {'label': label, 'seeds': len(runs), 'final_train': [], 'final_valid': [],
           'best_valid': [], 'steps_to_target': [], 'init_grad_ratio': [], 'tokens_per_sec': [],
           'num_params': None, 'diverged': [], 'plateaued': [], 'incomplete': 0,
           'tuned': runs[0].get('tuned')}  # {field: the value a tuned sweep chose}, or None
    for run in runs:
      _add_run(row, run, target_loss, target_split)
    summary.append(row)
  return summary


def _add_run(row, run, target_loss, target_split):
  """Adds one run's numbers and flags to the row of its group."""
  total = runs_lib.total_steps(run)
  train_steps, train_losses = run['train']
  _, valid_losses = run['valid']
  diverged_at = divergence(train_steps, train_losses, total)
  row['diverged'].append(diverged_at)
  level = run['info'].get('unigram_entropy')
  row['plateaued'].append(
      diverged_at is None and plateaued(train_steps, train_losses, total, level))
  if diverged_at is None and (not len(train_steps) or train_steps[-1] < total):
    row['incomplete'] += 1
  row['final_train'].append(float(train_losses[-1]) if len(train_losses) else None)
  row['init_grad_ratio'].append(_init_grad_ratio(run))
  row['final_valid'].append(float(valid_losses[-1]) if len(valid_losses) else None)
  finite = valid_losses[np.isfinite(valid_losses)]
  row['best_valid'].append(float(finite.min()) if len(finite) else None)
  if target_loss is not None:
    row['steps_to_target'].append(steps_to_target(*run[target_split], target_loss))
  rate = _steady_tokens_per_sec(run['rows'])
  if rate is not None:
    row['tokens_per_sec'].append(rate)
  row['num_params'] = run['info'].get('num_params', row['num_params'])


def _init_grad_ratio(run):
  """The first block's gradient norm at initialisation over the last block's, or None."""
  blocks = run['init_grad'].get('blocks') or []
  if len(blocks) < 2 or not blocks[-1]:
    return None
  return blocks[0] / blocks[-1]


def _steady_tokens_per_sec(rows):
  """The median training throughput of the log windows after the first, or None."""
  # The first window includes compilation: the median of the others is the steady rate.
  rates = [r.get('tokens_per_sec') for r in rows[1:]
           if r.get('split') == 'train' and r.get('tokens_per_sec')]
  return float(np.median(rates)) if rates else None


def flag_words(row):
  """The legend's flags of a summary row: ['diverged 1/3', 'plateau'] (a count where not all
  seeds), and the final validation loss's verdict against a baseline ('n.s.', 'better', 'worse')
  where `tools.compare.stats` gave one."""
  words = []
  hits = (('diverged', sum(d is not None for d in row['diverged'])),
          ('plateau', sum(row['plateaued'])))
  for word, count in hits:
    if count:
      words.append(word if count == row['seeds'] else f'{word} {count}/{row["seeds"]}')
  if row.get('verdict') in ('better', 'worse', 'n.s.'):  # against --baseline (tools.compare.stats)
    words.append(row['verdict'])
  return words
