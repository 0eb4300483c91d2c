"""Compares train.py runs: overlaid loss curves (PNG), divergence/plateau flags, a markdown table.

    python -m tools.compare DIR [DIR ...] [--out=PNG] [--smooth=ema:0.9] [--logy] [--logx]
        [--target_loss=3.0 [--target_split=train]] [--color_by=FIELD] [--style_by=FIELD]
        [--band=minmax|std|none]

Runs are workdirs (metrics.jsonl, config.json, run_info.json); a sweep directory stands for every
workdir inside it. Runs whose configs differ only in `train.seed` form one group, drawn as the mean
across seeds with a band (min-max by default). The table names each group by its full overrides;
the picture's one legend (outside the panels) by the fields that differ, abbreviated
(`post · 12L · lr 1e-3 · no warmup · plateau`, at most about 40 characters: beyond that each field's
most common value is left out and named once in the legend's title). The colour follows one field
(--color_by; by default the one with the fewest values, the study's main contrast among equals), the
line style another (--style_by), and the other differing fields the shade of the colour.

Flags (on the raw train loss of each run, documented in the table's footnote):
- diverged: a non-finite loss, or a spike: after the first 10% of the run's steps, a train loss
  above 2x the running minimum of the train losses logged so far.
- plateaued: not diverged, the final train loss is within 5% of the train loss at 25% of the run
  (>= 0.95x it), and it is above 0.9x the unigram entropy of the training tokens (run_info.json;
  the loss of a model that learned token frequencies only). Without that entropy the level is half
  the first logged train loss.
"""

import json
import math
import sys

from absl import app
from absl import flags
import numpy as np

from training import paths as paths_lib  # local or gs:// (the arguments are `paths` here)
from tools import extrapolation_compare
from tools import plot_style
from tools import plots
from tools.plot_style import band, smooth  # pylint: disable=g-importing-member  (compare.band)
# Reading runs (tools/runs.py); find_runs, load_run and differing_fields are used as compare.NAME.
from tools.runs import (  # pylint: disable=g-importing-member
    differing_fields, find_runs, load_run, total_steps)

SPIKE_FACTOR = 2.0  # diverged: train loss > this x the running minimum ...
SPIKE_AFTER = 0.10  # ... after this share of the steps
PLATEAU_AT = 0.25  # plateaued: final loss compared with the loss at this share of the steps ...
PLATEAU_TOLERANCE = 0.05  # ... improved by less than this share ...
PLATEAU_LEVEL = 0.9  # ... and above this x the unigram entropy


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


def group_runs(runs):
  """[(label, [runs])]: runs whose configs differ only in tools.runs.IGNORED_FIELDS share a group.

  The label lists the fields that differ between groups (`norm_position=post,warmup_steps=0`,
  section prefixes dropped where unambiguous); a single group is labelled by its directory. It is
  the markdown table's cell name; the legend uses `legend_labels`.
  """
  differing = differing_fields(runs)
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
          paths_lib.basename(paths_lib.dirname(members[0]['workdir'])) or
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


def summarize(groups, target_loss=None, target_split='valid'):
  """Per group: the table's numbers and flags. Returns a list of dicts (one per group)."""
  if target_split not in ('train', 'valid'):
    raise ValueError(f'--target_split: {target_split!r} unknown; valid: train, valid')
  if target_loss is not None and not math.isfinite(target_loss):
    raise ValueError(f'--target_loss={target_loss} must be a finite loss, e.g. 2.0')
  out = []
  for label, runs in groups:
    row = {'label': label, 'seeds': len(runs), 'final_train': [], 'final_valid': [],
           'best_valid': [], 'steps_to_target': [], 'init_grad_ratio': [], 'tokens_per_sec': [],
           'num_params': None, 'diverged': [], 'plateaued': [], 'incomplete': 0}
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
      row['final_train'].append(float(tl[-1]) if len(tl) else None)
      blocks = r['init_grad'].get('blocks') or []  # the first block's init grad over the last's
      row['init_grad_ratio'].append(blocks[0] / blocks[-1] if blocks[1:] and blocks[-1] else None)
      row['final_valid'].append(float(vl[-1]) if len(vl) else None)
      row['best_valid'].append(float(finite.min()) if len(finite) else None)
      if target_loss is not None:
        row['steps_to_target'].append(steps_to_target(*r[target_split], target_loss))
      # The first window includes compilation: the median of the others is the steady rate.
      tps = [x.get('tokens_per_sec') for x in r['rows'][1:]
             if x.get('split') == 'train' and x.get('tokens_per_sec')]
      if tps:
        row['tokens_per_sec'].append(float(np.median(tps)))
      row['num_params'] = r['info'].get('num_params', row['num_params'])
    out.append(row)
  return out


def markdown_table(summary, target_loss=None, target_split='valid'):
  """The summary as a markdown table, with a footnote defining the flags."""
  head = ['cell', 'seeds', 'final train', 'final valid', 'best valid']
  if target_loss is not None:
    head.append(f'steps to {target_split} <= {target_loss:g}')
  has_init = any(v is not None for row in summary for v in row['init_grad_ratio'])
  if has_init:
    head.append('init grad first/last block')
  head += ['tokens/s', 'params', 'flags']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for row in summary:
    cells = [row['label'], str(row['seeds']), _stat(row['final_train']),
             _stat(row['final_valid']), _stat(row['best_valid'])]
    if target_loss is not None:
      reached = [s for s in row['steps_to_target'] if s is not None]
      cells.append(f'{_stat(reached, "{:.0f}")} ({len(reached)}/{row["seeds"]})' if reached
                   else f'never (0/{row["seeds"]})')
    if has_init:
      cells.append(_stat(row['init_grad_ratio'], '{:.3g}'))
    cells.append(_stat(row['tokens_per_sec'], '{:.0f}'))
    cells.append(f'{row["num_params"]:,}' if row['num_params'] else '-')
    div = [d for d in row['diverged'] if d is not None]
    flags = ([f'DIVERGED {len(div)}/{row["seeds"]} (step {min(div)})'] if div else []) + (
        [f'PLATEAU {sum(row["plateaued"])}/{row["seeds"]}'] if any(row['plateaued']) else []) + (
        [f'incomplete {row["incomplete"]}/{row["seeds"]}'] if row['incomplete'] else [])
    cells.append(', '.join(flags) or 'ok')
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines.append('')
  init = ('init grad first/last block: the first block\'s gradient norm at initialisation over '
          'the last block\'s. ') if has_init else ''
  lines.append(f'Mean [min, max] across seeds; final train: the last logged training loss. {init}'
               f'DIVERGED: a non-finite loss, or a train loss above '
               f'{SPIKE_FACTOR:g}x its running minimum after {SPIKE_AFTER:.0%} of the steps. '
               f'PLATEAU: the final train loss within {PLATEAU_TOLERANCE:.0%} of the loss at '
               f'{PLATEAU_AT:.0%} of the steps and above {PLATEAU_LEVEL:g}x the unigram entropy.')
  return '\n'.join(lines)


def flag_words(row):
  """The legend's flags of a summary row: ['diverged 1/3', 'plateau'] (a count where not all
  seeds)."""
  words = []
  for word, hits in (('diverged', sum(d is not None for d in row['diverged'])),
                     ('plateau', sum(row['plateaued']))):
    if hits:
      words.append(word if hits == row['seeds'] else f'{word} {hits}/{row["seeds"]}')
  return words


def figure(groups, summary, *, smoothing=None, logy=False, logx=False, title=None, color_by=None,
           style_by=None, band_kind='minmax'):
  """The comparison figure (not saved): train loss, validation loss, init gradient norm per block.

  Each group is its mean across seeds with a `band_kind` band, in the colour and line style of
  `assign_styles`; a dotted vertical line marks a step where a run diverged, a grey line the
  unigram entropy. Groups whose init gradient norms are identical (cells that differ in training
  settings only) are drawn once in that panel. One legend for all panels sits outside them: in the
  fourth cell of a 2 x 2 grid when the runs logged init gradient norms, else below the two loss
  panels.

  Returns:
    (figure, labels): the matplotlib figure and the legend label of each group.
  """
  plt = plot_style.pyplot()
  configs = [runs[0]['config'] for _, runs in groups]
  fields = differing_fields([r for _, runs in groups for r in runs])
  color_field, style_field = plot_style.choose_style_fields(configs, fields, color_by, style_by)
  styles = plot_style.assign_styles(configs, fields, color_field, style_field)
  labels, note = plot_style.legend_labels(configs, fields, [flag_words(row) for row in summary],
                               keep=(color_field, style_field))
  if len(set(labels)) < len(labels) or not all(configs) or not all(labels):
    # Runs without config.json, or one group (no field differs): the table's names, cut short.
    most = plot_style.MAX_LABEL + 10
    cut = lambda s: s if len(s) <= most else s[:most - 1] + '…'  # noqa: E731
    labels = [plot_style.SEPARATOR.join([cut(label)] + flag_words(row))
              for (label, _), row in zip(groups, summary)]
    note = ''
  has_init = any(r['init_grad'].get('blocks') for _, runs in groups for r in runs)
  with plt.rc_context(plot_style.STYLE):
    if has_init:
      fig, axd = plt.subplot_mosaic([['train', 'valid'], ['init', 'legend']],
                                    figsize=(plot_style.WIDTH, 6.6), layout='constrained')
    else:
      fig, axd = plt.subplot_mosaic([['train', 'valid']], figsize=(plot_style.WIDTH, 3.6),
                                    layout='constrained')
    handles, drawn_init = [], set()
    for i, ((_, runs), row) in enumerate(zip(groups, summary)):
      st = styles[i]
      line = dict(color=st['color'], linestyle=st['linestyle'])
      for split in ('train', 'valid'):
        ax = axd[split]
        curves = [(s, smooth(l, smoothing) if split == 'train' else l)
                  for s, l in (r[split] for r in runs) if len(s)]
        if not curves:
          continue
        steps, mean, lo, hi = band(curves, band_kind)
        ax.plot(steps, mean, marker='o' if split == 'valid' else None, markersize=3.5, **line)
        if len(curves) > 1 and band_kind != 'none':
          ax.fill_between(steps, lo, hi, color=st['color'], alpha=0.12, linewidth=0)
        for d in row['diverged'] if split == 'train' else ():
          if d is not None:
            ax.axvline(d, color=st['color'], linestyle=':', linewidth=1.0, alpha=0.7)
      if has_init:
        per_run = [r['init_grad']['blocks'] for r in runs if r['init_grad'].get('blocks')]
        depth = min(map(len, per_run)) if per_run else 0
        # Cells that differ in training settings only start from the same weights: draw them once.
        key = json.dumps(np.round([p[:depth] for p in per_run], 6).tolist()) if depth else None
        if depth and key not in drawn_init:
          drawn_init.add(key)
          g = np.array([p[:depth] for p in per_run])  # [runs, layers]
          layers = np.arange(1, depth + 1)
          axd['init'].plot(layers, g.mean(0), marker='o', markersize=3.5, **line)
          if len(per_run) > 1 and band_kind != 'none':
            lo, hi = ((g.min(0), g.max(0)) if band_kind == 'minmax' else
                      (g.mean(0) - g.std(0), g.mean(0) + g.std(0)))
            axd['init'].fill_between(layers, lo, hi, color=st['color'], alpha=0.15, linewidth=0)
      handles.append(plt.Line2D([], [], **line))
    entropy = [r['info']['unigram_entropy'] for _, runs in groups for r in runs
               if r['info'].get('unigram_entropy')]
    for split, name in (('train', 'train loss' + (f' (smoothed {smoothing})' if smoothing else '')),
                        ('valid', 'validation loss')):
      ax = axd[split]
      ax.set_title(name)
      ax.set_xlabel('step')
      ax.grid(alpha=0.3)
      if entropy:
        ax.axhline(float(np.mean(entropy)), color='0.55', linewidth=0.9, linestyle=(0, (5, 3)),
                   zorder=0)
      if logx:
        plot_style.plain_log_axis(ax.xaxis)
      if logy:
        plot_style.plain_log_axis(ax.yaxis)
    axd['train'].set_ylabel('loss (nats/token)')
    if entropy:
      axd['train'].text(0.99, float(np.mean(entropy)), 'unigram entropy', color='0.4',
                        fontsize=8, ha='right', va='bottom',
                        transform=axd['train'].get_yaxis_transform())
    if has_init:
      ax = axd['init']
      ax.set_title('gradient norm at initialisation')
      ax.set_xlabel('block (1 = nearest the input)')
      ax.set_ylabel('gradient norm')
      ax.xaxis.get_major_locator().set_params(integer=True)
      ax.grid(alpha=0.3)
    seeds = sorted({len(runs) for _, runs in groups})
    legend_title = []
    if seeds != [1]:
      spread = {'minmax': 'band: min to max', 'std': 'band: mean -/+ std', 'none': 'no band'}
      count = str(seeds[0]) if len(seeds) == 1 else f'{seeds[0]} to {seeds[-1]}'
      legend_title.append(f'mean of {count} seeds, {spread[band_kind]}')
    if note:
      legend_title.append(note)
    order = sorted(range(len(groups)),
                   key=lambda i: (styles[i]['hue'], styles[i]['style'], styles[i]['shade']))
    legend = dict(handles=[handles[i] for i in order], labels=[labels[i] for i in order],
                  title='\n'.join(legend_title) or None, frameon=False, handlelength=2.6,
                  alignment='left')
    if has_init:
      axd['legend'].axis('off')
      axd['legend'].legend(loc='center left', **legend)
    else:
      longest = max(map(len, labels), default=1)
      ncol = max(1, min(len(labels), int(plot_style.WIDTH * 72 / (longest * 5.2 + 45))))
      fig.legend(loc='outside lower center', ncol=ncol, **legend)
    if title:
      fig.suptitle(title)
  return fig, labels


def plot(groups, summary, out, *, smoothing=None, logy=False, logx=False, title=None,
         color_by=None, style_by=None, band_kind='minmax'):
  """Draws `figure(...)` into the PNG `out`; returns `out`."""
  plt = plot_style.pyplot()
  fig, _ = figure(groups, summary, smoothing=smoothing, logy=logy, logx=logx, title=title,
                  color_by=color_by, style_by=style_by, band_kind=band_kind)
  paths_lib.makedirs(paths_lib.dirname(paths_lib.absolute(out)))
  plots.save_figure(fig, out)
  plt.close(fig)
  return out


def compare(paths, out, *, smoothing=None, logy=False, logx=False, target_loss=None,
            target_split='valid', color_by=None, style_by=None, band_kind='minmax'):
  """Loads the runs under `paths`, draws `out` (PNG) and returns the markdown summary table.

  Args:
    paths: workdirs and sweep directories.
    out: the PNG to write.
    smoothing: the train curves' `smooth` spec.
    logy: log-scale loss axes.
    logx: log-scale step axes.
    target_loss: tabulate the first logged step at which the loss reaches this.
    target_split: the loss `target_loss` is read from: 'valid' or 'train'.
    color_by: the field that picks the hue (None: `rank_fields`'s first; 'none': one per group).
    style_by: the field that picks the line style (None: automatic; 'none': solid lines).
    band_kind: the spread across seeds: 'minmax', 'std' or 'none'.

  Returns:
    The markdown table, the groups labelled with their full overrides (then, for runs with
    eval.json extrapolation rows, `extrapolation_compare`'s table).
  """
  runs = [load_run(w) for w in find_runs(paths)]
  smooth(np.zeros(1), smoothing)  # reject a bad --smooth or --band before any work
  band([(np.zeros(1), np.zeros(1))], band_kind)
  groups = group_runs(runs)
  summary = summarize(groups, target_loss, target_split)
  title = ', '.join(paths_lib.basename(p) for p in paths)
  title = f'{title}: ' if len(title) <= 60 else ''
  title += f'{len(runs)} runs in {len(groups)} cells' if len(groups) > 1 else f'{len(runs)} runs'
  plot(groups, summary, out, smoothing=smoothing, logy=logy, logx=logx, title=title,
       color_by=color_by, style_by=style_by, band_kind=band_kind)
  # Runs evaluated with eval.py --lengths: their table, and loss per position (OUT_extrapolation.png).
  extra = extrapolation_compare.report(groups, out, band_kind)
  return markdown_table(summary, target_loss, target_split) + (f'\n\n{extra}' if extra else '')


# --- The command line -----------------------------------------------------------------------------

FLAGS = flags.FLAGS


def define_flags():
  """The CLI flags, defined only when run as a program (tests import this module)."""
  flags.DEFINE_string('smooth', None, 'Train-curve smoothing: ema:BETA (or BETA), ma:K, or none.')
  flags.DEFINE_bool('logy', False, 'Log-scale loss axis.')
  flags.DEFINE_bool('logx', False, 'Log-scale step axis.')
  flags.DEFINE_float('target_loss', None, 'Report the first logged step whose loss (see '
                     '--target_split) is at most this.')
  flags.DEFINE_enum('target_split', 'valid', ['valid', 'train'], 'The loss --target_loss reads: '
                    'validation (every eval_every steps) or training (every log_every steps).')
  flags.DEFINE_string('out', None, 'The PNG to write, local or gs:// (default: '
                      'DIR/compare.png of the first DIR).')
  flags.DEFINE_string('color_by', None, 'The config field whose values pick the colour (e.g. '
                      'model.norm_position, or its last part); default: the field with the fewest '
                      'values that still separates the runs; none: one colour per group.')
  flags.DEFINE_string('style_by', None, 'The config field (at most 4 values) whose values pick '
                      'the line style (e.g. model.num_layers); default: the next such field when '
                      'colour alone does not tell the groups apart; none: solid lines.')
  flags.DEFINE_string('band', 'minmax', 'The band around each group\'s mean across seeds: minmax, '
                      'std (mean -/+ one standard deviation) or none.')


def main(argv):
  """Prints the table and `wrote OUT`; exits 2 on a missing run or a bad option."""
  # Positional arguments, not a comma-separated flag: cell workdirs have commas in their names.
  paths = argv[1:]
  if not paths:
    print('compare: name at least one workdir or sweep directory: python -m tools.compare DIR '
          '[DIR ...]', file=sys.stderr)
    sys.exit(2)
  out = FLAGS.out or paths_lib.join(paths[0], 'compare.png')
  try:
    table = compare(paths, out, smoothing=FLAGS.smooth, logy=FLAGS.logy, logx=FLAGS.logx,
                    target_loss=FLAGS.target_loss, target_split=FLAGS.target_split,
                    color_by=FLAGS.color_by,
                    style_by=FLAGS.style_by, band_kind=FLAGS.band)
  except (FileNotFoundError, ValueError) as e:
    print(str(e), file=sys.stderr)
    sys.exit(2)
  print(table)
  print(f'\nwrote {out}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
