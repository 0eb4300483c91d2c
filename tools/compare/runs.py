"""train.py runs as tools read them: workdirs found, each run's record loaded, configs compared."""

import functools
import json
import os
import re
import socket
import time

import numpy as np

from training import lock as lock_lib
from training import paths as paths_lib  # local or gs://
from training import writers

IGNORED_FIELDS = ('train.seed', 'data.data_dir')  # differences that do not make a new group


def is_workdir(path):
  """Whether `path` holds a run (its metrics.jsonl)."""
  return paths_lib.exists(paths_lib.join(path, 'metrics.jsonl'))


def find_runs(paths):
  """Workdirs from a list of workdirs and sweep directories (sorted within a sweep)."""
  runs = []
  for path in paths:
    if is_workdir(path):
      runs.append(path)
    elif paths_lib.isdir(path):
      cells = [paths_lib.join(path, name) for name in paths_lib.listdir(path)]
      runs.extend(cell for cell in cells if is_workdir(cell))
    else:
      raise FileNotFoundError(f'compare: {path} is neither a workdir nor a directory')
  if not runs:
    raise FileNotFoundError(f'compare: no metrics.jsonl in {", ".join(paths)}')
  return runs


def load_runs(paths):
  """The runs under `paths` that can be compared, and [(workdir, why)] of those left out: a run
  still training (its lock is held) or one whose metrics.jsonl or JSON files do not read."""
  runs, left_out = [], []
  for workdir in find_runs(paths):
    why = running(workdir)
    if why is None:
      try:
        runs.append(load_run(workdir))
        continue
      except ValueError as e:
        why = ' '.join(str(e).split())
    left_out.append((workdir, why))
  if not runs:
    raise FileNotFoundError('compare: no run to compare in ' + ', '.join(paths) + ': ' + '; '.join(
        f'{paths_lib.basename(w)} {why}' for w, why in left_out))
  return runs, left_out


def running(workdir):
  """'still running (...)' while a train.py holds the workdir's lock, else None. The lock file
  names its holder ('PID HOST', and the time on gs://) and is emptied at a clean exit: a holder on
  this host is running while its PID lives, an object lock while its heartbeat is fresh; a lock
  file of another host cannot be told from a killed one's and counts as running."""
  path = paths_lib.join(workdir, 'lock')
  try:
    holder = paths_lib.read_text(path).split() if paths_lib.exists(path) else []
  except OSError:
    return None
  if len(holder) < 2 or not holder[0].isdigit():
    return None
  pid, host = int(holder[0]), holder[1]
  if len(holder) >= 3:  # an object lock: its heartbeat's time
    alive = time.time() - float(holder[2]) < lock_lib.STALE_SECS
  elif host == socket.gethostname():
    try:
      os.kill(pid, 0)
      alive = True
    except ProcessLookupError:
      alive = False
    except PermissionError:
      alive = True
  else:
    alive = True
  return f'still running (PID {pid} on {host} holds its lock)' if alive else None


def flatten(d, prefix=''):
  """{'model': {'d_model': 64}} -> {'model.d_model': 64} (config.json comparisons)."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = v
  return out


@functools.lru_cache(maxsize=1)
def _default_fields():
  from configs import default
  return flatten(json.loads(default.get_config().to_json_best_effort()))


def _read_json(path):
  """The JSON file at `path`, {} when there is none; a damaged one is named in one line."""
  if not paths_lib.exists(path):
    return {}
  try:
    return paths_lib.read_json(path)
  except ValueError as e:  # json.JSONDecodeError
    raise ValueError(f'compare: {path} is not valid JSON ({e}); repair or remove it') from None


def _read_config(workdir):
  """The run's config.json as a flat dotted dict ({} without one)."""
  config = flatten(_read_json(paths_lib.join(workdir, 'config.json')))
  if config:  # fields attnlab gained after the run was written hold their defaults
    config = {**_default_fields(), **config}
  if config.get('train.init_from'):  # a sweep's fine-tunes start from their own seed's source
    config['train.init_from'] = re.sub(r',seed=\d+$', '', config['train.init_from'].rstrip('/'))
  return config


def _curve(rows, split):
  """(steps, losses) arrays of one split's rows, sorted by step."""
  points = sorted((r['step'], r['loss']) for r in rows if r.get('split') == split)
  steps = np.array([step for step, _ in points], np.int64)
  losses = np.array([loss for _, loss in points], np.float64)
  return steps, losses


def load_run(workdir):
  """{'workdir', 'config' (flat dotted dict), 'train'/'valid' (steps, losses arrays), 'rows',
  'info' (run_info.json), 'init_grad' (init_grad_norms.json or {})}."""
  rows = writers.read_metrics(paths_lib.join(workdir, 'metrics.jsonl'))
  return {
      'workdir': workdir,
      'name': paths_lib.basename(workdir),
      'rows': rows,
      'config': _read_config(workdir),
      'info': _read_json(paths_lib.join(workdir, 'run_info.json')),
      'init_grad': _read_json(paths_lib.join(workdir, 'init_grad_norms.json')),
      'train': _curve(rows, 'train'),
      'valid': _curve(rows, 'valid'),
  }


def total_steps(run):
  """The run's configured steps (config.json), else its last logged step."""
  steps = run['config'].get('train.steps')
  if steps:
    return int(steps)
  logged = run['train'][0]
  return int(logged[-1]) if len(logged) else 0


def _distinct_values(runs, field):
  """The values `field` takes across runs, as JSON text (config values may be unhashable lists)."""
  return {json.dumps(r['config'].get(field), sort_keys=True) for r in runs}


def differing_fields(runs):
  """The config fields (sorted) whose values differ between runs, seeds and data_dir aside, and a
  field every run was tuned on (`run['tuned']`, tools/compare/tune_table.py): each cell at its own
  value is one cell, not one per value."""
  tuned = set.intersection(*(set(r.get('tuned') or ()) for r in runs)) if runs else set()
  keys = sorted(set().union(*(r['config'] for r in runs)) - set(IGNORED_FIELDS) - tuned)
  return [k for k in keys if len(_distinct_values(runs, k)) > 1]
