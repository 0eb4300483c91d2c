"""A ladder's picture (`OUT_ladder.png`): final validation loss against training FLOPs, log axes,
each variant's frontier points with their 95% intervals across seeds and its fitted law, in the
Okabe-Ito palette (colour-blind-safe), the baseline in black."""

import numpy as np

from training import paths as paths_lib
from tools.plots import style as plot_style

PALETTE = ('#0072B2', '#D55E00', '#009E73', '#CC79A7', '#E69F00', '#56B4E9', '#F0E442')


def draw(result, cells, path):
  """Writes the picture to `path` and returns it.

  Args:
    result: `tools.compare.ladder.analyse`'s dict.
    cells: `tools.compare.ladder.collect`'s (every size's mean drawn faintly behind the frontier).
    path: the PNG.
  """
  plt = plot_style.pyplot()
  budgets = result['budgets']
  grid = np.geomspace(min(budgets) / 1.5, max(budgets) * 1.5, 100)
  colors = iter(PALETTE)
  with plt.rc_context(plot_style.STYLE):
    fig, ax = plt.subplots(figsize=(plot_style.WIDTH, 5.0), layout='constrained')
    for name, cell in result['cells'].items():
      color = '#000000' if name == result['baseline'] else next(colors, '#444444')
      for entry in cells.get(name, {}).values():  # every size: the isoFLOP points behind
        ax.plot(entry['compute'], np.mean(list(entry['losses'].values())), '.', color=color,
                alpha=0.25)
      points = sorted(cell['by_budget'].values(), key=lambda e: e['compute'])
      xs = [e['compute'] for e in points]
      ys = [e['loss']['mean'] for e in points]
      lo = [e['loss']['ci95'][0] for e in points]
      hi = [e['loss']['ci95'][1] for e in points]
      if None not in lo:
        ax.errorbar(xs, ys, yerr=[np.subtract(ys, lo), np.subtract(hi, ys)], fmt='o',
                    color=color, capsize=3)
      else:
        ax.plot(xs, ys, 'o', color=color)
      fit, m = cell['fit'], cell['multiplier']
      label = f'{name}: alpha {fit["alpha"]:.2f}'
      if m['value'] is not None and name != result['baseline']:
        label += f', x{m["value"]:.2g} compute, {cell["verdict"]}'
      ax.plot(grid, fit['E'] + fit['A'] * grid ** -fit['alpha'], '-', color=color, label=label)
    ax.set_xscale('log')
    ax.set_yscale('log')
    plot_style.plain_log_axis(ax.yaxis)
    ax.set_xlabel('training FLOPs')
    ax.set_ylabel('final validation loss')
    ax.grid(alpha=0.3, which='both')
    ax.legend(loc='upper right')
    ax.set_title(f'frontier and fitted L(C) = E + A·C^-alpha against {result["baseline"]}; '
                 'bars: 95% across seeds', fontsize=10)
  paths_lib.makedirs(paths_lib.dirname(paths_lib.absolute(path)))
  plot_style.save_figure(fig, path)
  plt.close(fig)
  return path
