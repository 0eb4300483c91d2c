"""Efficient attention: what each variant costs against what it loses, one table and one picture.

    .venv/bin/python -m tools.attention_tradeoff --sweep_dir=DIR \
        --costs=benchmarks/attention_variants.json [--length=16384] \
        [--out=benchmarks/attention_tradeoff.png]

Quality comes from a finished `configs/ablations/attention_variants.py` sweep run with
`--sweep_eval` (each cell's eval.json: validation loss, greedy exact match on test and test_long);
cost from `benchmarks/attention_variants.py --json=...` (fwd+bwd seconds and XLA temp memory of the
kernel alone). Prints a markdown table (mean [min, max] over seeds) and draws quality against
fwd+bwd time at `--length`, one point per variant, with dense attention in both exact kernels
(`xla`, `blockwise`) as references: they compute the same function (tests hold them equal to 1e-5),
so both carry the dense cells' quality.

A cost that was not measured because its temp memory exceeded the benchmark's limit (dense xla at
16k needs 32 GiB) is extrapolated from the longest measured length as T^2 and drawn hollow; the
table says so.
"""

import argparse
import json
import math
import os
import re

import numpy as np

from tools.compare import group_styles
from tools.plots import style as plot_style

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The kernels of the dense variant in the cost benchmark, and the labels they are shown under.
DENSE_KERNELS = (('dense', 'dense (xla)'), ('dense_flash', 'dense (blockwise)'))
TABLE_LENGTHS = (1024, 4096, 16384)
_FIELD = re.compile(r'(?:^|,)([a-z_.]+)=([^,]+)')


def cell_fields(name):
  """'model.attention=linformer,model.decoder_attention=dense,seed=1' -> {field: value}."""
  return dict(_FIELD.findall(name))


def read_quality(sweep_dir):
  """{variant: {'val_loss': [...], 'test_em': [...], 'long_em': [...], 'decoder': str}} over the
  seeds of every cell of `sweep_dir` that has an eval.json (cells without one are skipped)."""
  out = {}
  for name in sorted(os.listdir(sweep_dir)):
    path = os.path.join(sweep_dir, name, 'eval.json')
    fields = cell_fields(name)
    variant = fields.get('model.attention', 'dense')
    if variant == 'dense' and fields.get('model.decoder_attention', 'dense') != 'dense':
      variant = fields['model.decoder_attention']  # a causal-only variant under a dense encoder
    if fields.get('train.learning_rate'):
      variant += f', lr {fields["train.learning_rate"]}'
    if not os.path.isfile(path):
      if _diverged(os.path.join(sweep_dir, name)):
        _entry(out, variant, fields)['diverged'] += 1
      continue
    with open(path) as f:
      ev = json.load(f)
    trans = ev.get('translation', {})
    entry = _entry(out, variant, fields)
    entry['val_loss'].append(ev['loss']['validation'])
    entry['test_em'].append(trans.get('test', {}).get('exact_match', math.nan))
    entry['long_em'].append(trans.get('test_long', {}).get('exact_match', math.nan))
  return out


def _entry(out, variant, fields):
  decoder = fields.get('model.decoder_attention', '')
  return out.setdefault(variant, {'val_loss': [], 'test_em': [], 'long_em': [], 'diverged': 0,
                                  'decoder': '' if decoder == variant.split(',')[0] else decoder})


def _diverged(workdir):
  """True when the cell's train.log says it stopped on a non-finite loss or gradient."""
  log = os.path.join(workdir, 'train.log')
  if not os.path.isfile(log):
    return False
  with open(log, errors='replace') as f:
    return 'non-finite' in f.read()


def read_costs(path):
  """{(kernel, length): {'seconds': float or None, 'temp_bytes': int}} of the fwd_bwd rows."""
  with open(path) as f:
    rows = json.load(f)['rows']
  return {(r['variant'], r['length']): r for r in rows if r['mode'] == 'fwd_bwd'}


def time_at(costs, kernel, length):
  """(seconds at `length`, measured?) for `kernel`; when `length` was not run (temp over the
  limit), the longest measured length's time scaled by (length / T)^2 — the exact kernels' cost
  grows as T^2 — with measured=False; (None, False) when nothing was measured."""
  row = costs.get((kernel, length))
  if row and row['seconds'] is not None:
    return row['seconds'], True
  measured = sorted(t for (k, t), r in costs.items()
                    if k == kernel and r['seconds'] is not None and t < length)
  if not measured:
    return None, False
  t = measured[-1]
  return costs[kernel, t]['seconds'] * (length / t) ** 2, False


def _spread(values, fmt, scale=1.0):
  v = np.asarray(values, np.float64) * scale
  v = v[~np.isnan(v)]
  if not v.size:
    return 'n/a'
  if v.size == 1:
    return fmt.format(v[0])
  return f'{fmt.format(v.mean())} [{fmt.format(v.min())}, {fmt.format(v.max())}]'


def _seconds(secs, measured):
  """A table cell of a fwd+bwd time: measured, extrapolated (marked so) or 'n/a'."""
  if secs is None:
    return 'n/a'
  if measured:
    return f'{secs:.2f}'
  return f'~{secs:.0f} (T² extrapolated)'


def _mib(n):
  return f'{n / 2 ** 30:.2f} GiB' if n >= 2 ** 30 else f'{n / 2 ** 20:.0f} MiB'


def points(quality, costs, length):
  """Rows [(label, kernel, quality entry, seconds at `length`, measured?)], dense as two rows."""
  out = []
  for variant, entry in sorted(quality.items()):
    base = variant.split(',')[0]
    kernels = (DENSE_KERNELS if base == 'dense' else ((base, variant),))
    for kernel, label in kernels:
      if entry['decoder']:
        label = f'{label} (decoder: {entry["decoder"]})'
      secs, measured = time_at(costs, kernel, length)
      out.append((label, kernel, entry, secs, measured))
  return out


def table(rows, costs):
  """The markdown table: quality (mean [min, max] over seeds) and cost at TABLE_LENGTHS."""
  head = ['variant', 'seeds', 'validation loss', 'exact match test (%)',
          'exact match test_long (%)']
  head += [f'fwd+bwd {t // 1024}k (s)' for t in TABLE_LENGTHS]
  head += [f'temp {t // 1024}k' for t in TABLE_LENGTHS]
  lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for label, kernel, entry, _, _ in rows:
    seeds = len(entry['val_loss']) + entry['diverged']
    cells = [label, str(seeds), _spread(entry['val_loss'], '{:.4f}'),
             _spread(entry['test_em'], '{:.1f}', 100), _spread(entry['long_em'], '{:.1f}', 100)]
    if entry['diverged']:  # the finished seeds' quality, and how many stopped
      stopped = f'{entry["diverged"]} of {seeds} seeds diverged (non-finite gradient)'
      cells[2] = f'{cells[2]}; {stopped}' if entry['val_loss'] else stopped
    cells += [_seconds(*time_at(costs, kernel, t)) for t in TABLE_LENGTHS]
    for t in TABLE_LENGTHS:
      row = costs.get((kernel, t))
      cells.append('n/a' if row is None else _mib(row['temp_bytes']))
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def draw(rows, length, out):
  """Validation loss and test_long exact match against fwd+bwd time at `length` (log x)."""
  plt = plot_style.pyplot()
  with plt.rc_context(plot_style.STYLE):
    fig, axes = plt.subplots(1, 2, figsize=(plot_style.WIDTH, 4.2))
    panels = (('val_loss', 1.0, 'validation loss', 'lower is better'),
              ('long_em', 100.0, 'test_long exact match (%)', 'higher is better'))
    for ax, (key, scale, ylabel, title) in zip(axes, panels):
      ax.set_title(title)
      for i, (label, _, entry, secs, measured) in enumerate(rows):
        if secs is None:
          continue
        v = np.asarray(entry[key], np.float64) * scale
        v = v[~np.isnan(v)]
        if not v.size:
          continue
        if entry['diverged']:
          label += f' ({entry["diverged"]} of {len(v) + entry["diverged"]} seeds diverged)'
        color = group_styles.PALETTE[i % len(group_styles.PALETTE)]
        ax.errorbar([secs], [v.mean()], yerr=[[v.mean() - v.min()], [v.max() - v.mean()]],
                    fmt='o', color=color, mfc=color if measured else 'white', ms=7, capsize=3,
                    label=label + ('' if measured else ' (time T² extrapolated)'))
      ax.set_xscale('log')
      ax.set_xlabel(f'kernel fwd+bwd time at T={length:,} (s, log)')
      ax.set_ylabel(ylabel)
      ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc='lower center', ncol=3, frameon=False)
    fig.suptitle('Efficient attention: quality (mean, seed min-max) against cost')
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(out, dpi=plot_style.DPI)
    plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--sweep_dir', required=True)
  p.add_argument('--costs', required=True, help='JSON of benchmarks/attention_variants.py --json')
  p.add_argument('--length', type=int, default=16384)
  p.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'attention_tradeoff.png'))
  args = p.parse_args(argv)
  quality = read_quality(args.sweep_dir)
  if not quality:
    p.error(f'--sweep_dir={args.sweep_dir}: no cell has an eval.json (run the sweep with '
            '--sweep_eval)')
  rows = points(quality, read_costs(args.costs), args.length)
  print(table(rows, read_costs(args.costs)))
  draw(rows, args.length, args.out)
  print(f'\nwrote {args.out}')


if __name__ == '__main__':
  main()
