"""Length extrapolation across runs (tools.compare): a table of mean [min, max] across seeds and the
loss per window position with seed bands, from each workdir's eval.json (eval.py --lengths).

Per run, from the non-overlapping windows: the loss at the training length L, the ratios
r_k = loss(k L) / loss(L) for k = 2, 4, 8, the loss on target tokens only at 4L and 8L, and the
loss by position within windows of L (`position_losses`: positions 0-3, 4-15, 16-63, ... ). A
cell's evaluation variants (a sweep's eval_variants, kept as eval_<flag>.json) get rows of their
own, `cell [eval rope_scaling=ntk_4]`.

When some runs started from another run's parameters (train.init_from: context extension), a
second table compares every cell at the base's length L and at 4L in tokens, against the base's
own loss at L of the same seed (the base: the runs with no init_from, at the shortest length).
"""

import math

import numpy as np

from training import paths as paths_lib
from tools.compare import curves as curves_lib
from tools.compare import group_styles
from tools.compare import legend
from tools.plots import style as plot_style
from tools.compare import runs as runs_lib

RATIOS = (2, 4, 8)  # r_k = loss at k x L / loss at L
TARGET_AT = (4, 8)  # target-token loss at these multiples
MODE = 'non_overlapping'  # the windows whose per-position losses eval.py keeps


def load_eval(workdir, name='eval.json'):
  """The eval.json of a workdir (the evaluation as trained), or None."""
  path = paths_lib.join(workdir, name)
  return paths_lib.read_json(path) if paths_lib.exists(path) else None


def _row(rows, multiple, key, field='multiple'):
  """`key` of the `MODE` row whose `field` ('multiple', or 'length' in tokens) is `multiple`."""
  for r in rows:
    if r.get('mode') == MODE and math.isclose(float(r[field]), multiple):
      return r.get(key)
  return None


def run_metrics(result):
  """{'loss_L', 'r2', 'r4', 'r8', 'target_4L', 'target_8L'} of one eval.json (None if missing)."""
  rows = (result or {}).get('extrapolation') or []
  base = _row(rows, 1, 'loss')
  out = {'loss_L': base}
  for k in RATIOS:
    loss = _row(rows, k, 'loss')
    out[f'r{k}'] = loss / base if loss is not None and base else None
  for k in TARGET_AT:
    out[f'target_{k}L'] = _row(rows, k, 'target_loss')
  return out


def position_losses(result):
  """{'loss_pos@a-b': the mean loss at positions a..b of the non-overlapping windows of the training
  length} of one eval.json, in buckets 4 times wider each time: 0-3, 4-15, 16-63, 64-255, ... up
  to the window's last position; {} without that length's per-position losses."""
  rows = (result or {}).get('extrapolation') or []
  length = _row(rows, 1, 'length')
  curve = ((result or {}).get('extrapolation_per_position') or {}).get(str(length))
  if not curve:
    return {}
  curve, out, lo = np.asarray(curve, np.float64), {}, 0
  while lo < len(curve):
    hi = min(4 * max(lo, 1), len(curve))  # 0-3, 4-15, 16-63, ...
    out[f'loss_pos@{lo}-{hi - 1}'] = float(curve[lo:hi].mean())
    lo = hi
  return out


def _stat(values):
  """'mean [min, max]' across seeds ('m' for one, '-' for none)."""
  values = [v for v in values if v is not None and math.isfinite(v)]
  if not values:
    return '-'
  if len(values) == 1:
    return f'{values[0]:.3f}'
  return f'{np.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]'


def eval_names(runs):
  """The evaluation files of a group's runs: 'eval.json' first, then the variants' (sorted)."""
  names = set()
  for r in runs:
    names.update(n for n in paths_lib.listdir(r['workdir'])
                 if n.startswith('eval') and n.endswith('.json'))
  return sorted(names, key=lambda n: (n != 'eval.json', n))


def row_label(label, name):
  """`label` for eval.json, `label [eval FLAG]` for a variant's eval_FLAG.json."""
  return label if name == 'eval.json' else f'{label} [eval {name[len("eval_"):-len(".json")]}]'


def markdown_table(groups):
  """The table over `tools.compare.summary.group_runs` groups that have eval.json extrapolation rows
  ('' when none has), one row per cell and evaluation variant; then `extension_table`."""
  keys = ['loss_L'] + [f'r{k}' for k in RATIOS] + [f'target_{k}L' for k in TARGET_AT]
  head = (['cell', 'seeds', 'loss at L'] + [f'r{k}' for k in RATIOS]
          + [f'target loss {k}L' for k in TARGET_AT])
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, runs in groups:
    for name in eval_names(runs):
      metrics = [run_metrics(load_eval(r['workdir'], name)) for r in runs]
      metrics = [m for m in metrics if m['loss_L'] is not None]
      if metrics:
        cells = [row_label(label, name), str(len(metrics))]
        cells += [_stat([m[k] for m in metrics]) for k in keys]
        lines.append('| ' + ' | '.join(cells) + ' |')
  if len(lines) == 2:
    return ''
  lines += ['', f'Mean [min, max] across seeds; {MODE} windows; r_k = loss at kL / loss at L; '
            'target loss: on target tokens only.']
  table = '\n'.join(lines)
  extension = extension_table(groups)
  return f'{table}\n\n{extension}' if extension else table


def _loss_at(result, length):
  """The loss of `MODE` windows of `length` tokens in an eval.json, or None."""
  return _row((result or {}).get('extrapolation') or [], length, 'loss', field='length')


def extension_table(groups, multiple=4):
  """Context extension: each cell (and variant) at the base's L and at `multiple` x L tokens, and
  its loss at `multiple` x L over the base's loss at L of the same seed. '' when no run has a
  train.init_from or no base was evaluated."""
  runs = [r for _, rs in groups for r in rs]
  if not any(r['config'].get('train.init_from') for r in runs):
    return ''
  sources = [r for r in runs if not r['config'].get('train.init_from')]
  lengths = [r['config'].get('data.max_length') for r in sources]
  if not sources or None in lengths:
    return ''
  length = min(lengths)
  base = {}  # seed -> the base's loss at L
  for r in sources:
    loss = _loss_at(load_eval(r['workdir']), length)
    if r['config'].get('data.max_length') == length and loss is not None:
      base[r['config'].get('train.seed')] = loss
  if not base:
    return ''
  far = multiple * length
  head = ['cell', 'seeds', f'loss at {length} (L)', f'loss at {far} ({multiple}L)',
          f'{multiple}L / base at L']
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, rs in groups:
    for name in eval_names(rs):
      near, at_far, ratio = [], [], []
      for r in rs:
        result = load_eval(r['workdir'], name)
        near.append(_loss_at(result, length))
        at_far.append(_loss_at(result, far))
        ref = base.get(r['config'].get('train.seed'))
        ratio.append(at_far[-1] / ref if at_far[-1] is not None and ref else None)
      seeds = sum(v is not None for v in at_far)
      if seeds:
        lines.append('| ' + ' | '.join([row_label(label, name), str(seeds), _stat(near),
                                        _stat(at_far), _stat(ratio)]) + ' |')
  return '\n'.join(lines + ['', f'Mean [min, max] across seeds; {MODE} windows, lengths in tokens; '
                             f'the base: the runs without train.init_from at L = {length}; the '
                             f'ratio divides by the base\'s loss at L of the same seed.'])


def per_position(groups):
  """{label: {length: [curve per seed]}} from eval.json's `extrapolation_per_position`."""
  out = {}
  for label, runs in groups:
    for r in runs:
      curves = (load_eval(r['workdir']) or {}).get('extrapolation_per_position') or {}
      for length, curve in curves.items():
        out.setdefault(label, {}).setdefault(int(length), []).append(np.asarray(curve, np.float64))
  return out


# The curves the ratio row divides by, where a group has this config (the best long-range method
# of the position study, so the other methods read as how much worse they are).
REFERENCE = {'model.position': 'alibi', 'model.random_positions_max': 0}
# The ratio row shows the methods near the reference: its axis fits every curve up to here, and
# stops here where one goes higher (the clipped curves are marked at the top edge and named; the
# loss row above has them whole).
RATIO_TOP = 1.5


def legend_labels(groups):
  """(short legend label per group, note) from `tools.compare.legend`, as tools.compare's figure
  has."""
  configs = [runs[0].get('config') or {} for _, runs in groups]
  fields = runs_lib.differing_fields([r for _, runs in groups for r in runs])
  if not fields or not all(configs):
    return [label for label, _ in groups], ''
  return legend.legend_labels(configs, fields)


def _reference(groups):
  """The index of the group whose config matches `REFERENCE`, or None."""
  for i, (_, runs) in enumerate(groups):
    config = runs[0].get('config') or {}
    if all(config.get(k, v if not v else None) == v for k, v in REFERENCE.items()):  # absent: 0
      return i
  return None


def _mean_curves(curves, lengths, train_length, band_kind):
  """{(group index, length): (positions, mean, lo, hi)}: long windows averaged over
  length // L positions as tools.plots does, then across seeds."""
  out = {}
  for i, by_length in enumerate(curves):
    for length in lengths:
      k = max(1, length // train_length)
      runs = [c[:len(c) // k * k].reshape(-1, k).mean(1) for c in by_length.get(length, [])]
      if runs:
        x = np.arange(len(runs[0])) * k + (k - 1) / 2
        out[i, length] = (*curves_lib.band([(x, r) for r in runs], band_kind), len(runs))
  return out


def figure(groups, band_kind='minmax'):
  """One column per evaluation length: each group's loss per position (mean across seeds with a
  `band_kind` band) and, below, its ratio to the `REFERENCE` group's (methods whose losses lie on
  top of each other come apart there). The legend, in tools.compare's short labels, sits right.

  Returns:
    (figure, axes), or None when no run has per-position losses.
  """
  by_label = per_position(groups)
  curves = [by_label.get(label, {}) for label, _ in groups]
  lengths = sorted({n for by_length in curves for n in by_length})
  if not lengths:
    return None
  plt = plot_style.pyplot()
  labels, note = legend_labels(groups)
  ref = _reference(groups)
  rows = 1 if ref is None else 2
  fig, axes = plt.subplots(rows, len(lengths), figsize=(3.3 * len(lengths) + 2.4, 2.7 * rows + 0.5),
                           squeeze=False, sharex='col')
  train_length = lengths[0]  # the shortest window: the training length of an x1 evaluation
  means = _mean_curves(curves, lengths, train_length, band_kind)
  colors = [plt.cm.tab10(i % 10) for i in range(len(groups))]
  # Line styles in turn too, so that groups are told apart without colour (ALiBi from KERPLE).
  styles = [group_styles.LINE_STYLES[i % len(group_styles.LINE_STYLES)]
            for i in range(len(groups))]
  clipped = set()
  for col, length in enumerate(lengths):
    ax = axes[0][col]
    for i in range(len(groups)):
      if (i, length) not in means:
        continue
      steps, mean, lo, hi, seeds = means[i, length]
      ax.plot(steps, mean, styles[i], color=colors[i], lw=1.2, label=f'{labels[i]} ({seeds})')
      if seeds > 1 and band_kind != 'none':
        ax.fill_between(steps, lo, hi, color=colors[i], alpha=0.15, linewidth=0)
    ax.set_title(f'{length}-token windows', fontsize=9)
    if ref is not None and (ref, length) in means:
      clipped |= _draw_ratios(axes[1][col], means, ref, length, colors, styles, labels)
    for row in axes[:, col]:
      row.axvline(train_length, color='0.5', ls=':', lw=1)
    axes[-1][col].set_xlabel('position in window (tokens)', fontsize=8)
  axes[0][0].set_ylabel('loss')
  if ref is not None:
    axes[1][0].set_ylabel(f'loss / {labels[ref]}\'s')
    if clipped:
      names = ', '.join(labels[i] for i in sorted(clipped))
      axes[1][0].annotate(f'▲ above {RATIO_TOP:g}, clipped: {names}', (0.0, -0.28),
                          xycoords='axes fraction', fontsize=6.5, color='0.3', va='top')
  handles, texts = axes[0][0].get_legend_handles_labels()
  spread = {'minmax': 'min to max', 'std': 'mean -/+ std', 'none': 'none'}[band_kind]
  title = f'(seeds): mean across seeds,\nband {spread}' + (f'\n{note}' if note else '')
  fig.legend(handles, texts, loc='center right', fontsize=7, frameon=False, title_fontsize=7,
             title=title)
  fig.subplots_adjust(left=0.05, right=1 - 2.3 / (3.3 * len(lengths) + 2.4), top=0.93,
                      bottom=0.1, wspace=0.22, hspace=0.12)
  return fig, axes


def _draw_ratios(ax, means, ref, length, colors, styles, labels):
  """Each group's mean loss per position over the reference group's, at the same positions; the
  axis fits them all up to `RATIO_TOP`, and a curve that goes higher is cut there and marked by a
  triangle at the top edge. Returns the indices of the clipped groups."""
  _, ref_mean, _, _, _ = means[ref, length]
  ratios = {i: (steps, mean / ref_mean) for (i, n), (steps, mean, _, _, _) in sorted(means.items())
            if n == length and len(mean) == len(ref_mean)}
  highest = max(float(np.max(r)) for _, r in ratios.values())
  top = min(RATIO_TOP, highest + 0.02 * (highest - 1.0) + 0.005)
  clipped = set()
  for i, (steps, ratio) in ratios.items():
    ax.plot(steps, ratio, styles[i], color=colors[i], lw=1.0 if i != ref else 1.6,
            label=labels[i])
    if np.max(ratio) > top:
      clipped.add(i)
      first = int(np.argmax(ratio > top))
      ax.plot(steps[first], top, '^', color=colors[i], markersize=5, clip_on=False)
  ax.axhline(1.0, color='0.6', lw=0.6)
  ax.set_ylim(top=top)
  return clipped


def report(groups, out, band_kind='minmax'):
  """Draws `figure` next to `out` (NAME_extrapolation.png) and returns the markdown table ('' and
  no picture when no run was evaluated for extrapolation)."""
  drawn = figure(groups, band_kind)
  if drawn is not None:
    plt = plot_style.pyplot()
    stem = out[:-4] if out.endswith('.png') else out
    plot_style.save_figure(drawn[0], f'{stem}_extrapolation.png')
    plt.close(drawn[0])
  return markdown_table(groups)
