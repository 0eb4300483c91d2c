"""Passkey retrieval across runs (tools.compare): the accuracy per length as mean [min, max] across
seeds; OUT_retrieval_lines.png, the accuracy against length per cell, mean with its 95% interval
across seeds (tools.compare.stats' bootstrap one, inside 0-100%; from 3 seeds), lengths in units
of the shortest training length L (fine-tunes dashed and named as such); and OUT_retrieval.png,
every cell's heat map averaged over its seeds on a colour-blind-safe map; from each workdir's
eval.json `retrieval` (eval.py on a data.task=passkey run).

A run's accuracy at a length is the mean over the report's depths (0-100% in 10% steps, the same
number of examples at each). A cell's evaluation variants (a sweep's eval_variants, kept as
eval_<flag>.json) get rows and panels of their own, `cell [eval rope_scaling=pi_4]`.
"""

import math
import textwrap

import numpy as np

from tools.compare import extrapolation as extrapolation_compare
from tools.compare import group_styles
from tools.plots import style as plot_style
from tools.plots import run_pictures
from tools.compare import stats as stats_lib

PANEL_COLUMNS = 4
BASE_STYLES = ('-', '-.', ':')  # cells at the base length, in turn ('--': trained longer)


def _accuracy_by_length(report):
  """{length in tokens: mean accuracy over depths} of one retrieval report."""
  return {int(n): float(np.mean(list(by_depth.values()))) for n, by_depth in report.items()}


def cell_rows(groups):
  """[(row label, training length, [retrieval report per seed])] of every group and evaluation
  file holding a retrieval report, in the groups' order."""
  return _labelled(_reports(groups), groups)


def _reports(groups):
  """[(group index, evaluation name, training length, [retrieval report per seed])]: every
  evaluation file read once."""
  out = []
  for i, (_, runs) in enumerate(groups):
    for name in extrapolation_compare.eval_names(runs):
      reports = [(extrapolation_compare.load_eval(r['workdir'], name) or {}).get('retrieval')
                 for r in runs]
      reports = [r for r in reports if r]
      if reports:
        out.append((i, name, runs[0].get('config', {}).get('data.max_length'), reports))
  return out


def _labelled(found, groups, labels=None):
  """`_reports`' rows labelled by `labels` (one per group; None: the groups' own labels)."""
  labels = labels or [label for label, _ in groups]
  return [(extrapolation_compare.row_label(labels[i], name), length, reports)
          for i, name, length, reports in found]


def _fine_tuned(found, groups):
  """Per `_reports` row: whether its cell started from another run's parameters."""
  return [bool((groups[i][1][0].get('config') or {}).get('train.init_from'))
          for i, _, _, _ in found]


def line_figure(rows, fine_tuned):
  """Accuracy against length per row of `cell_rows` (mean over depths, then across seeds with
  the 95% bootstrap interval as a band, from 3 seeds), lengths in units of the shortest training
  length L; a row trained longer is named by its length (`fine-tuned at 4L` where `fine_tuned`)
  and dashed."""
  plt = plot_style.pyplot()
  base = min(length for _, length, _ in rows)
  with plt.rc_context(plot_style.STYLE):
    fig, ax = plt.subplots(figsize=(plot_style.WIDTH * 0.75, 3.6), layout='constrained')
    ticks = set()
    for i, ((label, length, reports), tuned) in enumerate(zip(rows, fine_tuned)):
      by_length = [_accuracy_by_length(r) for r in reports]
      xs = sorted(n for n in by_length[0] if all(n in b for b in by_length))
      # A bounded score: the bootstrap interval stays inside 0-100% where a t interval would not.
      found = [stats_lib.bootstrap_interval([100 * b[n] for b in by_length]) for n in xs]
      mean = np.array([m for m, _ in found])
      color = group_styles.PALETTE[i % len(group_styles.PALETTE)]
      if length != base:
        label += f' ({"fine-tuned" if tuned else "trained"} at {length / base:g}L)'
      style = '--' if length != base else BASE_STYLES[i % len(BASE_STYLES)]
      units = [n / base for n in xs]
      ax.plot(units, mean, style, color=color, marker='o', markersize=3.5, lw=1.3,
              label=f'{label} ({len(reports)})')
      if len(reports) > 2:  # the bootstrap has no 95% interval at 2 seeds
        ax.fill_between(units, [lo for _, (lo, _) in found], [hi for _, (_, hi) in found],
                        color=color, alpha=0.15, linewidth=0)
      ticks.update(units)
    ax.set_xscale('log', base=2)
    ax.set_xticks(sorted(ticks), [f'{t:g}L' for t in sorted(ticks)])
    ax.minorticks_off()
    ax.set_ylim(-3, 103)
    ax.axvline(1.0, color='0.5', ls=':', lw=1)
    ax.set_xlabel(f'length (L = {base} tokens)')
    ax.set_ylabel('retrieval accuracy (%)')
    ax.legend(fontsize=6.5, loc='center left', bbox_to_anchor=(1.01, 0.5), frameon=False,
              title='(seeds): mean, band 95% bootstrap interval', title_fontsize=6.5)
  return fig


def _stat(values):
  """'mean [min, max]' in percent across seeds ('m' for one)."""
  values = [100 * v for v in values]
  if len(values) == 1:
    return f'{values[0]:.1f}'
  return f'{np.mean(values):.1f} [{min(values):.0f}, {max(values):.0f}]'


def markdown_table(rows):
  """The accuracy by length of every row of `cell_rows` ('' when there is none)."""
  if not rows:
    return ''
  lengths = sorted({n for _, _, reports in rows for rep in reports
                    for n in _accuracy_by_length(rep)})
  head = ['cell', 'seeds', 'trained at'] + [f'{n} tokens' for n in lengths]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, train_length, reports in rows:
    by_length = [_accuracy_by_length(rep) for rep in reports]
    cells = [label, str(len(reports)), str(train_length)]
    for n in lengths:
      values = [b[n] for b in by_length if n in b]
      cells.append(_stat(values) if len(values) == len(by_length) else '-')
    lines.append('| ' + ' | '.join(cells) + ' |')
  lines += ['', 'Passkey retrieval accuracy (%): at each length the mean over the key depths '
            '0-100%; mean [min, max] across seeds.']
  return '\n'.join(lines)


def mean_report(reports):
  """The seeds' reports averaged cell by cell (the lengths and depths every report has)."""
  lengths = [n for n in reports[0] if all(n in r for r in reports)]
  return {n: {d: float(np.mean([r[n][d] for r in reports])) for d in reports[0][n]
              if all(d in r[n] for r in reports)} for n in lengths}


def figure(rows):
  """Every row's heat map (mean over seeds), PANEL_COLUMNS to a line; the matplotlib figure."""
  plt = plot_style.pyplot()
  columns = min(PANEL_COLUMNS, len(rows))
  lines = math.ceil(len(rows) / columns)
  with plt.rc_context(plot_style.STYLE):
    fig, axes = plt.subplots(lines, columns, figsize=(plot_style.WIDTH * columns / 4 + 0.6,
                                                      3.1 * lines), layout='constrained',
                             squeeze=False)
    image = None
    for ax, (label, train_length, reports) in zip(axes.flat, rows):
      image = run_pictures.draw_retrieval(ax, mean_report(reports), train_length, fontsize=5.5)
      ax.set_title('\n'.join(textwrap.wrap(f'{label} ({len(reports)} seeds)', 34)), fontsize=7.5)
      ax.tick_params(labelsize=6.5)
    for ax in axes.flat[len(rows):]:
      ax.set_visible(False)
    fig.supxlabel('length (tokens)', fontsize=9)
    fig.supylabel('depth of the key', fontsize=9)
    fig.colorbar(image, ax=axes, label='retrieval accuracy (mean over seeds)', shrink=0.6)
  return fig


def report(groups, out):
  """Draws `figure` next to `out` (NAME_retrieval.png) and returns the markdown table ('' and no
  picture when no run has a retrieval report)."""
  found = _reports(groups)
  if not found:
    return ''
  # The panels and lines are labelled by the legend's short labels (the table keeps the full
  # overrides).
  short = _labelled(found, groups, extrapolation_compare.legend_labels(groups)[0])
  stem = out[:-4] if out.endswith('.png') else out
  for fig, name in ((line_figure(short, _fine_tuned(found, groups)), 'retrieval_lines'),
                    (figure(short), 'retrieval')):
    plot_style.save_figure(fig, f'{stem}_{name}.png')
    plot_style.pyplot().close(fig)
  return markdown_table(_labelled(found, groups))
