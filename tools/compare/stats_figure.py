"""The statistics of a comparison as a picture (`OUT_intervals.png`): each cell's mean as a dot
with its 95% interval across seeds, one panel per headline metric, coloured by the verdict
against the baseline (colour-blind-safe: Okabe-Ito blue better, vermillion worse, grey not
separable, black the baseline). Where the final losses of many cells coincide, dots with intervals
show what overlaid curves hide."""

from training import paths as paths_lib
from tools.plots import style as plot_style

COLORS = {'better': '#0072B2', 'worse': '#D55E00', 'n.s.': '#888888', 'baseline': '#000000',
          'n/a': '#444444', None: '#444444'}
# The panels, in order: the first that some cell has of each group.
HEADLINES = (('final_valid',), ('accuracy.test',), ('r4', 'r8', 'r2'))
MAX_LABEL = 38


def panels(stats):
  """The metrics drawn: of each `HEADLINES` group, the first some cell has."""
  have = {name for by_metric in stats.values() for name in by_metric}
  out = []
  for group in HEADLINES:
    found = [name for name in group if name in have]
    if found:
      out.append(found[0])
  return out


def path_of(out):
  return (out[:-4] if out.endswith('.png') else out) + '_intervals.png'


def _label(text):
  return text if len(text) <= MAX_LABEL else text[:MAX_LABEL - 1] + '…'


def draw(stats, out, baseline=None):
  """Writes the picture beside `out` and returns its path, or None when no cell has a metric."""
  metrics = panels(stats)
  if not metrics:
    return None
  plt = plot_style.pyplot()
  cells = list(stats)
  height = 1.2 + 0.32 * len(cells)
  with plt.rc_context(plot_style.STYLE):
    fig, axes = plt.subplots(1, len(metrics), figsize=(plot_style.WIDTH, height), sharey=True,
                             squeeze=False, layout='constrained')
    for ax, metric in zip(axes[0], metrics):
      for row, cell in enumerate(cells):
        entry = stats[cell].get(metric)
        if entry is None:
          continue
        lo, hi = entry['ci95']
        color = COLORS.get(entry['verdict'], COLORS[None])
        if lo is not None:
          ax.plot([lo, hi], [row, row], color=color, linewidth=2.2, solid_capstyle='butt')
        ax.plot(entry['mean'], row, 'o', color=color, markersize=6)
      ax.set_title(metric)
      ax.grid(axis='x', alpha=0.3)
    axes[0][0].invert_yaxis()  # the first cell on top (the axes share y)
    axes[0][0].set_yticks(range(len(cells)), [_label(c) for c in cells])
    note = (f'mean and 95% interval across seeds; colour: verdict against {baseline} (blue better, '
            'vermillion worse, grey n.s.)' if baseline else 'mean and 95% interval across seeds')
    fig.suptitle(note, fontsize=9)
  path = path_of(out)
  paths_lib.makedirs(paths_lib.dirname(paths_lib.absolute(path)))
  plot_style.save_figure(fig, path)
  plt.close(fig)
  return path
