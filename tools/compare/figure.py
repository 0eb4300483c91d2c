"""The comparison's picture: train loss, validation loss and init gradient norm per block.

One legend for all panels sits outside them, its labels from tools/compare/legend.py, each group's
colour and line style from tools/compare/group_styles.py, its mean and band across seeds from
tools/compare/curves.py.
"""

import json

import numpy as np

from training import paths as paths_lib  # local or gs://
from tools.compare import curves as curves_lib
from tools.compare import group_styles
from tools.compare import legend
from tools.plots import style as plot_style
from tools.compare import runs as runs_lib
from tools.compare import summary as summary_lib

BAND_WORDS = {'minmax': 'band: min to max', 'std': 'band: mean -/+ std', 'none': 'no band'}


def figure(groups, summary, *, smoothing=None, logy=False, logx=False, title=None, color_by=None,
           style_by=None, band_kind='minmax'):
  """The comparison figure (not saved): train loss, validation loss, init gradient norm per block.

  Each group is its mean across seeds with a `band_kind` band, in the colour and line style of
  `tools.compare.group_styles.assign_styles`; a dotted vertical line marks a step where a run
  diverged, a grey line the unigram entropy. Groups whose init gradient norms are identical (cells
  that differ in training settings only) are drawn once in that panel. One legend for all panels
  sits outside them: in the fourth cell of a 2 x 2 grid when the runs logged init gradient norms,
  else below the two loss panels.

  Args:
    groups: `tools.compare.summary.group_runs`'s [(label, runs)].
    summary: `tools.compare.summary.summarize`'s rows of those groups.
    smoothing: the train curves' `tools.compare.curves.smooth` spec.
    logy: log-scale loss axes.
    logx: log-scale step axes.
    title: the figure's title, or None.
    color_by: the field that picks the hue (`tools.compare.group_styles.choose_style_fields`).
    style_by: the field that picks the line style.
    band_kind: the spread across seeds: 'minmax', 'std' or 'none'.

  Returns:
    (figure, labels): the matplotlib figure and the legend label of each group.
  """
  plt = plot_style.pyplot()
  styles, labels, note = group_look(groups, summary, color_by, style_by)
  has_init = any(r['init_grad'].get('blocks') for _, runs in groups for r in runs)
  with plt.rc_context(plot_style.STYLE):
    fig, axd = _panels(plt, has_init)
    handles, drawn_init = [], set()
    for (_, runs), row, style in zip(groups, summary, styles):
      line = {'color': style['color'], 'linestyle': style['linestyle']}
      _draw_losses(axd, runs, row, line, smoothing, band_kind)
      if has_init:
        _draw_init_gradients(axd['init'], runs, line, band_kind, drawn_init)
      handles.append(plt.Line2D([], [], **line))
    _label_loss_panels(axd, smoothing, _entropy_level(groups), logx, logy)
    if has_init:
      _label_init_panel(axd['init'])
    add_legend(fig, axd, handles, labels, styles, legend_title(groups, band_kind, note))
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
  plot_style.save_figure(fig, out)
  plt.close(fig)
  return out


def group_look(groups, summary, color_by=None, style_by=None):
  """(styles, labels, note): each group's `tools.compare.group_styles` style and legend label, and
  the legend's note, as every picture of one comparison draws them."""
  configs = [runs[0]['config'] for _, runs in groups]
  fields = runs_lib.differing_fields([r for _, runs in groups for r in runs])
  color_field, style_field = group_styles.choose_style_fields(configs, fields, color_by, style_by)
  styles = group_styles.assign_styles(configs, fields, color_field, style_field)
  labels, note = _labels(groups, summary, configs, fields, keep=(color_field, style_field))
  return styles, labels, note


def _labels(groups, summary, configs, fields, keep):
  """(labels, note) of the legend: `tools.compare.legend.legend_labels`, or the table's names cut
  short when runs lack config.json or no field tells the groups apart."""
  flags = [summary_lib.flag_words(row) for row in summary]
  labels, note = legend.legend_labels(configs, fields, flags, keep=keep)
  if len(set(labels)) == len(labels) and all(configs) and all(labels):
    return labels, note
  most = legend.MAX_LABEL + 10
  names = [label if len(label) <= most else label[:most - 1] + '…' for label, _ in groups]
  return [legend.SEPARATOR.join([name] + words) for name, words in zip(names, flags)], ''


def _panels(plt, has_init):
  """(figure, {panel name: axes}): the two loss panels, and with `has_init` the init gradient
  panel and the legend's cell below them."""
  if has_init:
    return plt.subplot_mosaic([['train', 'valid'], ['init', 'legend']],
                              figsize=(plot_style.WIDTH, 6.6), layout='constrained')
  return plt.subplot_mosaic([['train', 'valid']], figsize=(plot_style.WIDTH, 3.6),
                            layout='constrained')


def _draw_losses(axd, runs, row, line, smoothing, band_kind):
  """One group's train and validation loss, mean and band across seeds, and a dotted line at each
  step where one of its runs diverged."""
  for split in ('train', 'valid'):
    curves = []
    for run in runs:
      steps, losses = run[split]
      if len(steps):
        if split == 'train':
          losses = curves_lib.smooth(losses, smoothing)
        curves.append((steps, losses))
    if not curves:
      continue
    ax = axd[split]
    steps, mean, lo, hi = curves_lib.band(curves, band_kind)
    ax.plot(steps, mean, marker='o' if split == 'valid' else None, markersize=3.5, **line)
    if len(curves) > 1 and band_kind != 'none':
      ax.fill_between(steps, lo, hi, color=line['color'], alpha=0.12, linewidth=0)
    if split == 'train':
      for step in row['diverged']:
        if step is not None:
          ax.axvline(step, color=line['color'], linestyle=':', linewidth=1.0, alpha=0.7)


def _draw_init_gradients(ax, runs, line, band_kind, drawn):
  """One group's gradient norm per block at initialisation, mean and band across seeds, unless
  a group with the same norms was drawn (their keys are in `drawn`)."""
  per_run = [r['init_grad']['blocks'] for r in runs if r['init_grad'].get('blocks')]
  depth = min(map(len, per_run)) if per_run else 0
  if not depth:
    return
  norms = np.array([p[:depth] for p in per_run])  # [runs, blocks]
  # Cells that differ in training settings only start from the same weights: draw them once.
  key = json.dumps(np.round(norms, 6).tolist())
  if key in drawn:
    return
  drawn.add(key)
  blocks = np.arange(1, depth + 1)
  mean = norms.mean(0)
  ax.plot(blocks, mean, marker='o', markersize=3.5, **line)
  if len(per_run) > 1 and band_kind != 'none':
    if band_kind == 'minmax':
      lo, hi = norms.min(0), norms.max(0)
    else:
      lo, hi = mean - norms.std(0), mean + norms.std(0)
    ax.fill_between(blocks, lo, hi, color=line['color'], alpha=0.15, linewidth=0)


def _entropy_level(groups):
  """The mean unigram entropy of the runs' training tokens (run_info.json), or None."""
  entropy = [r['info']['unigram_entropy'] for _, runs in groups for r in runs
             if r['info'].get('unigram_entropy')]
  return float(np.mean(entropy)) if entropy else None


def _label_loss_panels(axd, smoothing, entropy, logx, logy):
  """Titles, grids, log axes, and the unigram entropy's grey line, of the two loss panels."""
  train_title = 'train loss' + (f' (smoothed {smoothing})' if smoothing else '')
  for split, name in (('train', train_title), ('valid', 'validation loss')):
    ax = axd[split]
    ax.set_title(name)
    ax.set_xlabel('step')
    ax.grid(alpha=0.3)
    if entropy is not None:
      ax.axhline(entropy, color='0.55', linewidth=0.9, linestyle=(0, (5, 3)), zorder=0)
    if logx:
      plot_style.plain_log_axis(ax.xaxis)
    if logy:
      plot_style.plain_log_axis(ax.yaxis)
  axd['train'].set_ylabel('loss (nats/token)')
  if entropy is not None:
    axd['train'].text(0.99, entropy, 'unigram entropy', color='0.4', fontsize=8, ha='right',
                      va='bottom', transform=axd['train'].get_yaxis_transform())


def _label_init_panel(ax):
  ax.set_title('gradient norm at initialisation')
  ax.set_xlabel('block (1 = nearest the input)')
  ax.set_ylabel('gradient norm')
  ax.xaxis.get_major_locator().set_params(integer=True)
  ax.grid(alpha=0.3)


def legend_title(groups, band_kind, note):
  """'mean of 2 seeds, band: min to max' (where a group has several seeds) over the labels' note,
  or None."""
  seeds = sorted({len(runs) for _, runs in groups})
  lines = []
  if seeds != [1]:
    count = str(seeds[0]) if len(seeds) == 1 else f'{seeds[0]} to {seeds[-1]}'
    lines.append(f'mean of {count} seeds, {BAND_WORDS[band_kind]}')
  if note:
    lines.append(note)
  return '\n'.join(lines) or None


def add_legend(fig, axd, handles, labels, styles, title):
  """The one legend, ordered by hue, line style and shade: in the grid's free cell when there is
  one, else below the panels in as many columns as fit."""
  order = sorted(range(len(labels)),
                 key=lambda i: (styles[i]['hue'], styles[i]['style'], styles[i]['shade']))
  legend_args = dict(handles=[handles[i] for i in order], labels=[labels[i] for i in order],
                     title=title, frameon=False, handlelength=2.6, alignment='left')
  if 'legend' in axd:
    axd['legend'].axis('off')
    axd['legend'].legend(loc='center left', **legend_args)
    return
  longest = max(map(len, labels), default=1)
  # About 5.2 points per character of the longest label and 45 for its handle and gap.
  ncol = max(1, min(len(labels), int(plot_style.WIDTH * 72 / (longest * 5.2 + 45))))
  fig.legend(loc='outside lower center', ncol=ncol, **legend_args)
