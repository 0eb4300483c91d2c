"""Figure sizes, the matplotlib set-up and the PNG writer every picture of tools/ shares.

How compared runs look is decided elsewhere: curves and seed bands in tools/compare/curves.py,
legend labels in tools/compare/legend.py, colours and line styles in tools/compare/group_styles.py.
"""

import io
import math

from training import paths

# Sizes for a figure 9 inches wide shown at about 900 px (the README's width): 10 pt text is 14 px.
STYLE = {'font.size': 10, 'axes.titlesize': 11, 'axes.labelsize': 10, 'legend.fontsize': 9.5,
         'legend.title_fontsize': 9.5, 'xtick.labelsize': 9, 'ytick.labelsize': 9,
         'lines.linewidth': 1.7, 'axes.spines.top': False, 'axes.spines.right': False}
WIDTH = 9.0  # inches
DPI = 150  # the PNG is 1350 px wide: sharp when scaled down to 900 px


def save_figure(fig, path, dpi=DPI):
  """Writes `fig` as a PNG to `path`, local or gs:// (rendered in memory, written whole)."""
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png', dpi=dpi)
  paths.write_bytes(path, buffer.getvalue())


def pyplot():
  """matplotlib.pyplot on the Agg backend, matplotlib's font notices silenced."""
  import logging
  import matplotlib
  matplotlib.use('Agg')
  # absl routes matplotlib's one-line-per-font fallback notices to stderr: keep the table readable.
  logging.getLogger('matplotlib.font_manager').setLevel(logging.ERROR)
  import matplotlib.pyplot as plt
  return plt


def plain_log_axis(axis):
  """A log scale whose ticks read as plain numbers (2, 3, 4, 6) rather than 2x10^0."""
  from matplotlib import ticker
  if axis.axis_name == 'y':
    axis.axes.set_yscale('log')
    lo, hi = axis.axes.get_ylim()
  else:
    axis.axes.set_xscale('log')
    lo, hi = axis.axes.get_xlim()
  decades = math.log10(hi / lo) if lo > 0 and hi > lo else 1.0
  # Under 1.5 decades (a loss from 6 to 1.2) label 1, 1.5, 2, 3, 4, 6; wider ranges fewer.
  if decades < 1.5:
    subs = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
  elif decades < 3:
    subs = (1.0, 2.0, 5.0)
  else:
    subs = (1.0,)
  axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
  axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:g}'))
  axis.set_minor_formatter(ticker.NullFormatter())
