"""Compares train.py runs: overlaid loss curves (PNG), divergence/plateau flags, a markdown table.

    python -m tools.compare DIR [DIR ...] [--out=PNG] [--smooth=ema:0.9] [--logy] [--logx]
        [--target_loss=3.0]

Runs are workdirs (metrics.jsonl, config.json, run_info.json); a sweep directory stands for every
workdir inside it. Runs whose configs differ only in `train.seed` form one group, drawn as the mean
across seeds with a min-max band. Groups are labelled by the config fields that differ between them.

Flags (on the raw train loss of each run, documented in the table's footnote):
- diverged: a non-finite loss, or a spike: after the first 10% of the run's steps, a train loss
  above 2x the running minimum of the train losses logged so far.
- plateaued: not diverged, the final train loss is within 5% of the train loss at 25% of the run
  (>= 0.95x it), and it is above 0.9x the unigram entropy of the training tokens (run_info.json;
  the loss of a model that learned token frequencies only). Without that entropy the level is half
  the first logged train loss.
"""

import functools
import json
import math
import os
import sys

from absl import app
from absl import flags
import numpy as np

SPIKE_FACTOR = 2.0  # diverged: train loss > this x the running minimum ...
SPIKE_AFTER = 0.10  # ... after this share of the steps
PLATEAU_AT = 0.25  # plateaued: final loss compared with the loss at this share of the steps ...
PLATEAU_TOLERANCE = 0.05  # ... improved by less than this share ...
PLATEAU_LEVEL = 0.9  # ... and above this x the unigram entropy
IGNORED_FIELDS = ('train.seed', 'data.data_dir')  # differences that do not make a new group


def is_workdir(path):
  return os.path.exists(os.path.join(path, 'metrics.jsonl'))


def find_runs(paths):
  """Workdirs from a list of workdirs and sweep directories (sorted within a sweep)."""
  runs = []
  for path in paths:
    if is_workdir(path):
      runs.append(path)
    elif os.path.isdir(path):
      runs.extend(os.path.join(path, d) for d in sorted(os.listdir(path))
                  if is_workdir(os.path.join(path, d)))
    else:
      raise FileNotFoundError(f'compare: {path} is neither a workdir nor a directory')
  if not runs:
    raise FileNotFoundError(f'compare: no metrics.jsonl in {", ".join(paths)}')
  return runs


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
  from configs import default  # pylint: disable=g-import-not-at-top
  return flatten(json.loads(default.get_config().to_json_best_effort()))


def _read_json(path):
  if os.path.exists(path):
    with open(path) as f:
      return json.load(f)
  return {}


def load_run(workdir):
  """{'workdir', 'config' (flat dotted dict), 'train'/'valid' (steps, losses arrays), 'rows',
  'info' (run_info.json), 'init_grad' (init_grad_norms.json or {})}."""
  rows = []
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  config = flatten(_read_json(os.path.join(workdir, 'config.json')))
  if config:  # fields attnlab gained after the run was written hold their defaults
    config = {**_default_fields(), **config}
  run = {'workdir': workdir, 'name': os.path.basename(os.path.normpath(workdir)), 'rows': rows,
         'config': config,
         'info': _read_json(os.path.join(workdir, 'run_info.json')),
         'init_grad': _read_json(os.path.join(workdir, 'init_grad_norms.json'))}
  for split in ('train', 'valid'):
    points = sorted((r['step'], r['loss']) for r in rows if r.get('split') == split)
    run[split] = (np.array([p[0] for p in points], np.int64),
                  np.array([p[1] for p in points], np.float64))
  return run


def total_steps(run):
  """The run's configured steps (config.json), else its last logged step."""
  steps = run['config'].get('train.steps')
  if steps:
    return int(steps)
  return int(run['train'][0][-1]) if len(run['train'][0]) else 0


def divergence(steps, losses, total):
  """The first step at which the run diverged (see the module docstring), or None."""
  running_min = math.inf
  for step, loss in zip(steps, losses):
    if not math.isfinite(loss):
      return int(step)
    if step > SPIKE_AFTER * total and loss > SPIKE_FACTOR * running_min:
      return int(step)
    running_min = min(running_min, loss)
  return None


def plateaued(steps, losses, total, level):
  """Whether a run plateaued (module docstring); `level` the unigram entropy (or None)."""
  if len(losses) < 2 or not np.all(np.isfinite(losses)):
    return False
  if level is None:
    level = 0.5 * losses[0] / PLATEAU_LEVEL
  ref = losses[np.searchsorted(steps, PLATEAU_AT * total, side='left').clip(0, len(losses) - 1)]
  final = losses[-1]
  return bool(final >= (1.0 - PLATEAU_TOLERANCE) * ref and final > PLATEAU_LEVEL * level)


def steps_to_target(steps, losses, target):
  """The first logged step whose loss is <= target, or None."""
  hit = np.nonzero(np.isfinite(losses) & (losses <= target))[0]
  return int(steps[hit[0]]) if len(hit) else None


def smooth(losses, spec):
  """'ema:0.9' (debiased exponential moving average, as TensorBoard's slider), a bare float in
  (0, 1) (EMA), 'ma:K' (trailing moving average of K points), or None/'none'/'0'."""
  if spec in (None, '', 'none', '0'):
    return losses
  kind, _, value = spec.partition(':')
  if not value:
    kind, value = 'ema', kind
  x = np.asarray(losses, np.float64)
  if kind == 'ema':
    beta = float(value)
    if not 0.0 <= beta < 1.0:
      raise ValueError(f'--smooth: the EMA coefficient {beta} must be in [0, 1)')
    out, acc, weight = np.empty_like(x), 0.0, 0.0
    for i, v in enumerate(x):
      acc, weight = beta * acc + (1 - beta) * v, beta * weight + (1 - beta)
      out[i] = acc / weight
    return out
  if kind == 'ma':
    k = int(value)
    if k < 1:
      raise ValueError(f'--smooth: the moving-average window {k} must be >= 1')
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(len(x))
    lo = np.maximum(0, idx - k + 1)
    return (c[idx + 1] - c[lo]) / (idx + 1 - lo)
  raise ValueError(f'--smooth={spec!r}: valid forms: ema:BETA, BETA, ma:K, none')


def band(curves):
  """Mean and min-max across runs of (steps, losses) curves, on the union of their steps.

  A run missing a step (shorter, or stopped) or with a non-finite loss there does not count at that
  step. Returns (steps, mean, lo, hi) arrays.
  """
  steps = np.unique(np.concatenate([s for s, _ in curves])) if curves else np.array([], np.int64)
  grid = np.full((len(curves), len(steps)), np.nan)
  for i, (s, l) in enumerate(curves):
    grid[i, np.searchsorted(steps, s)] = np.where(np.isfinite(l), l, np.nan)
  keep = ~np.all(np.isnan(grid), 0)
  grid, steps = grid[:, keep], steps[keep]
  return steps, np.nanmean(grid, 0), np.nanmin(grid, 0), np.nanmax(grid, 0)


def group_runs(runs):
  """[(label, [runs])]: runs whose configs differ only in IGNORED_FIELDS share a group.

  The label lists the fields that differ between groups (`norm_position=post,warmup_steps=0`,
  section prefixes dropped where unambiguous); a single group is labelled by its directory.
  """
  keys = sorted(set().union(*(r['config'] for r in runs)) - set(IGNORED_FIELDS))
  differing = [k for k in keys if len({json.dumps(r['config'].get(k), sort_keys=True)
                                       for r in runs}) > 1]
  short = {k: k.split('.')[-1] for k in differing}
  if len(set(short.values())) < len(short):
    short = {k: k for k in differing}
  groups = {}
  for r in runs:
    sig = tuple(json.dumps(r['config'].get(k), sort_keys=True) for k in differing)
    if not r['config']:  # no config.json: its own group
      sig = ('dir', r['workdir'])
    groups.setdefault(sig, []).append(r)
  out = []
  for sig, members in groups.items():
    if differing and members[0]['config']:
      label = ','.join(f'{short[k]}={_fmt(members[0]["config"].get(k))}' for k in differing)
    else:
      label = members[0]['name'].split(',seed=')[0] if len(groups) > 1 else (
          os.path.basename(os.path.dirname(os.path.normpath(members[0]['workdir']))) or
          members[0]['name'])
    out.append((label, members))
  return out


def _fmt(value):
  return repr(value) if isinstance(value, float) else str(value)


def _stat(values, fmt='{:.4f}'):
  """'m' for one value, 'mean [min, max]' for several, '-' for none."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  if not values:
    return '-'
  if len(values) == 1:
    return fmt.format(values[0])
  return f'{fmt.format(np.mean(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]'


def summarize(groups, target_loss=None):
  """Per group: the table's numbers and flags. Returns a list of dicts (one per group)."""
  out = []
  for label, runs in groups:
    row = {'label': label, 'seeds': len(runs), 'final_valid': [], 'best_valid': [],
           'steps_to_target': [], 'tokens_per_sec': [], 'num_params': None,
           'diverged': [], 'plateaued': [], 'incomplete': 0}
    for r in runs:
      total = total_steps(r)
      ts, tl = r['train']
      vs, vl = r['valid']
      div = divergence(ts, tl, total)
      row['diverged'].append(div)
      level = r['info'].get('unigram_entropy')
      row['plateaued'].append(div is None and plateaued(ts, tl, total, level))
      if div is None and (not len(ts) or ts[-1] < total):
        row['incomplete'] += 1
      finite = vl[np.isfinite(vl)]
      row['final_valid'].append(float(vl[-1]) if len(vl) else None)
      row['best_valid'].append(float(finite.min()) if len(finite) else None)
      if target_loss is not None:
        row['steps_to_target'].append(steps_to_target(vs, vl, target_loss))
      # The first window includes compilation: the median of the others is the steady rate.
      tps = [x.get('tokens_per_sec') for x in r['rows'][1:]
             if x.get('split') == 'train' and x.get('tokens_per_sec')]
      if tps:
        row['tokens_per_sec'].append(float(np.median(tps)))
      row['num_params'] = r['info'].get('num_params', row['num_params'])
    out.append(row)
  return out


def markdown_table(summary, target_loss=None):
  """The summary as a markdown table, with a footnote defining the flags."""
  head = ['cell', 'seeds', 'final valid', 'best valid']
  if target_loss is not None:
    head.append(f'steps to valid <= {target_loss:g}')
  head += ['tokens/s', 'params', 'flags']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for row in summary:
    cells = [row['label'], str(row['seeds']), _stat(row['final_valid']), _stat(row['best_valid'])]
    if target_loss is not None:
      reached = [s for s in row['steps_to_target'] if s is not None]
      cells.append(f'{_stat(reached, "{:.0f}")} ({len(reached)}/{row["seeds"]})' if reached
                   else f'never (0/{row["seeds"]})')
    cells.append(_stat(row['tokens_per_sec'], '{:.0f}'))
    cells.append(f'{row["num_params"]:,}' if row['num_params'] else '-')
    flags = []
    div = [d for d in row['diverged'] if d is not None]
    if div:
      flags.append(f'DIVERGED {len(div)}/{row["seeds"]} (step {min(div)})')
    if any(row['plateaued']):
      flags.append(f'PLATEAU {sum(row["plateaued"])}/{row["seeds"]}')
    if row['incomplete']:
      flags.append(f'incomplete {row["incomplete"]}/{row["seeds"]}')
    cells.append(', '.join(flags) or 'ok')
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines.append('')
  lines.append(f'Mean [min, max] across seeds. DIVERGED: a non-finite loss, or a train loss above '
               f'{SPIKE_FACTOR:g}x its running minimum after {SPIKE_AFTER:.0%} of the steps. '
               f'PLATEAU: the final train loss within {PLATEAU_TOLERANCE:.0%} of the loss at '
               f'{PLATEAU_AT:.0%} of the steps and above {PLATEAU_LEVEL:g}x the unigram entropy.')
  return '\n'.join(lines)


def plot(groups, summary, out, *, smoothing=None, logy=False, logx=False, title=None):
  """Train (left) and validation (right) loss per group, mean with a min-max band across seeds;
  a third panel with the gradient norm per block at initialisation when the runs logged it."""
  import logging  # pylint: disable=g-import-not-at-top
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  # absl routes matplotlib's one-line-per-font fallback notices to stderr: keep the table readable.
  logging.getLogger('matplotlib.font_manager').setLevel(logging.ERROR)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  has_init = any(r['init_grad'].get('blocks') for _, runs in groups for r in runs)
  ncols = 3 if has_init else 2
  fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5))
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for i, ((label, runs), row) in enumerate(zip(groups, summary)):
    color = colors[i % len(colors)]
    flags = (' (diverged)' if any(d is not None for d in row['diverged']) else '') + (
        ' (plateau)' if any(row['plateaued']) else '')
    for ax, split in zip(axes[:2], ('train', 'valid')):
      curves = [(s, smooth(l, smoothing) if split == 'train' else l)
                for s, l in (r[split] for r in runs) if len(s)]
      if not curves:
        continue
      steps, mean, lo, hi = band(curves)
      ax.plot(steps, mean, color=color, label=label + flags,
              marker='o' if split == 'valid' else None, markersize=3)
      if len(runs) > 1:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.2, linewidth=0)
      for d in row['diverged']:
        if d is not None and split == 'train':
          ax.axvline(d, color=color, linestyle=':', alpha=0.6)
    if has_init:
      per_run = [r['init_grad']['blocks'] for r in runs if r['init_grad'].get('blocks')]
      depth = min(map(len, per_run)) if per_run else 0
      if depth:
        g = np.array([p[:depth] for p in per_run])  # [runs, layers]
        layers = np.arange(1, depth + 1)
        axes[2].plot(layers, g.mean(0), color=color, marker='o', markersize=3, label=label)
        if len(per_run) > 1:
          axes[2].fill_between(layers, g.min(0), g.max(0), color=color, alpha=0.2, linewidth=0)
  for ax, name in zip(axes, ('train loss' + (f' (smoothed {smoothing})' if smoothing else ''),
                             'validation loss', 'gradient norm at initialisation')):
    ax.set_title(name)
    ax.grid(alpha=0.3)
    if ax is not axes[-1] or not has_init:
      ax.set_xlabel('step')
      ax.set_ylabel('loss (nats/token)')
      if logx:
        ax.set_xscale('log')
    if logy:
      ax.set_yscale('log')
  if has_init:
    axes[2].set_xlabel('block (1 = nearest the input)')
    axes[2].set_ylabel('gradient norm')
  axes[0].legend(fontsize=7)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def compare(paths, out, *, smoothing=None, logy=False, logx=False, target_loss=None):
  """Loads the runs under `paths`, draws `out` (PNG) and returns the markdown summary table."""
  runs = [load_run(w) for w in find_runs(paths)]
  smooth(np.zeros(1), smoothing)  # reject a bad --smooth before any work
  groups = group_runs(runs)
  summary = summarize(groups, target_loss)
  title = ', '.join(os.path.basename(os.path.normpath(p)) for p in paths)
  plot(groups, summary, out, smoothing=smoothing, logy=logy, logx=logx, title=title)
  return markdown_table(summary, target_loss)


# --- The command line -----------------------------------------------------------------------------

FLAGS = flags.FLAGS


def define_flags():
  """The CLI flags, defined only when run as a program (tests import this module)."""
  flags.DEFINE_string('smooth', None, 'Train-curve smoothing: ema:BETA (or BETA), ma:K, or none.')
  flags.DEFINE_bool('logy', False, 'Log-scale loss axis.')
  flags.DEFINE_bool('logx', False, 'Log-scale step axis.')
  flags.DEFINE_float('target_loss', None, 'Report the first step whose validation loss is at most '
                     'this.')
  flags.DEFINE_string('out', None, 'The PNG to write (default: DIR/compare.png of the first DIR).')


def main(argv):
  """Prints the table and `wrote OUT`; exits 2 on a missing run or a bad option."""
  # Positional arguments, not a comma-separated flag: cell workdirs have commas in their names.
  paths = argv[1:]
  if not paths:
    print('compare: name at least one workdir or sweep directory: python -m tools.compare DIR '
          '[DIR ...]', file=sys.stderr)
    sys.exit(2)
  out = FLAGS.out or os.path.join(paths[0], 'compare.png')
  try:
    table = compare(paths, out, smoothing=FLAGS.smooth, logy=FLAGS.logy, logx=FLAGS.logx,
                    target_loss=FLAGS.target_loss)
  except (FileNotFoundError, ValueError) as e:
    print(str(e), file=sys.stderr)
    sys.exit(2)
  print(table)
  print(f'\nwrote {out}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
