"""Logged metrics beside the loss across runs (`tools.compare --metrics`): each metric over
training per group, mean and band across seeds, drawn into OUT_metrics.png, and a table of its
mean over the run and its last logged value, mean [min, max] across seeds.

For example the MoE layers' `moe_drop_fraction` and `moe_load_cv` (docs/moe.md), or `grad_norm`.
A per-layer diagnostic is named with its layer (`attn_sink_share/decoder/blocks/0`), or bare
(`attn_sink_share`, `attn_entropy`) for its mean over the layers a row logged it for.
"""

import numpy as np

from training import paths as paths_lib
from tools.compare import figure as compare_figure
from tools.compare import curves as curves_lib
from tools.plots import style as plot_style


def value(row, metric):
  """A row's `metric`; where the row has no such key, the mean of its per-layer values
  `metric/<layer>` (the diagnostics' `attn_sink_share/decoder/blocks/0`, ...); else None."""
  if metric in row:
    return row[metric]
  layers = [v for k, v in row.items() if k.startswith(metric + '/')]
  return float(np.mean(layers)) if layers else None


def curve(run, metric):
  """(steps, values) of `metric` (see `value`) in a run's training rows (empty where it never
  logged it)."""
  rows = [(r['step'], value(r, metric)) for r in run['rows'] if r.get('split') == 'train']
  rows = [(step, v) for step, v in rows if v is not None]
  return (np.asarray([step for step, _ in rows], np.int64),
          np.asarray([v for _, v in rows], np.float64))


def check_metrics(groups, metrics):
  """ValueError (one line) for a metric no run logged, naming those they did."""
  logged = sorted({k for _, runs in groups for r in runs for row in r['rows']
                   if row.get('split') == 'train' for k in row} - {'split', 'step'})
  for metric in metrics:
    if not any(len(curve(r, metric)[0]) for _, runs in groups for r in runs):
      raise ValueError(f'--metrics: no run logged {metric!r}; logged: {", ".join(logged)}')


def _spread(values):
  values = [v for v in values if np.isfinite(v)]
  if not values:
    return '–'
  if len(values) == 1:
    return f'{values[0]:.3g}'
  return f'{np.mean(values):.3g} [{min(values):.3g}, {max(values):.3g}]'


def markdown(groups, metrics):
  """| cell | <metric> mean over the run | <metric> last | ...: mean [min, max] across seeds."""
  head = ['cell'] + [f'{m} {what}' for m in metrics for what in ('(run mean)', '(last)')]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, runs in groups:
    cells = [label]
    for metric in metrics:
      curves = [curve(r, metric)[1] for r in runs]
      cells.append(_spread([float(np.mean(c)) for c in curves if len(c)]))
      cells.append(_spread([float(c[-1]) for c in curves if len(c)]))
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def draw(groups, summary, out, metrics, *, color_by=None, style_by=None, band_kind='minmax'):
  """One panel per metric, each group in the colours and labels of the loss picture; returns
  the PNG's path (`out` with `_metrics` before `.png`)."""
  plt = plot_style.pyplot()
  styles, labels, note = compare_figure.group_look(groups, summary, color_by, style_by)
  path = out[:-4] + '_metrics.png' if out.endswith('.png') else out + '_metrics.png'
  with plt.rc_context(plot_style.STYLE):
    fig, axes = plt.subplots(1, len(metrics), figsize=(plot_style.WIDTH, 3.6), squeeze=False,
                             layout='constrained')
    axd = {m: ax for m, ax in zip(metrics, axes[0])}
    handles, shown = [], []  # a group that logged none of the metrics stays out of the legend
    for i, ((_, runs), style) in enumerate(zip(groups, styles)):
      line = {'color': style['color'], 'linestyle': style['linestyle']}
      for metric, ax in axd.items():
        curves = [c for c in (curve(r, metric) for r in runs) if len(c[0])]
        if not curves:
          continue
        steps, mean, lo, hi = curves_lib.band(curves, band_kind)
        ax.plot(steps, mean, **line)
        if len(curves) > 1 and band_kind != 'none':
          ax.fill_between(steps, lo, hi, color=line['color'], alpha=0.12, linewidth=0)
        if not shown or shown[-1] != i:
          shown.append(i)
          handles.append(plt.Line2D([], [], **line))
    labels, styles = [labels[i] for i in shown], [styles[i] for i in shown]
    for metric, ax in axd.items():
      ax.set_title(metric)
      ax.set_xlabel('step')
      ax.grid(alpha=0.3)
    compare_figure.add_legend(fig, axd, handles, labels, styles,
                              compare_figure.legend_title(groups, band_kind, note))
  paths_lib.makedirs(paths_lib.dirname(paths_lib.absolute(path)))
  plot_style.save_figure(fig, path)
  plt.close(fig)
  return path


def report(groups, summary, out, metrics, **look):
  """The table of `markdown` after drawing `draw`'s picture; '' without metrics."""
  if not metrics:
    return ''
  check_metrics(groups, metrics)
  path = draw(groups, summary, out, metrics, **look)
  return f'Logged metrics (picture: {path}):\n\n' + markdown(groups, metrics)
