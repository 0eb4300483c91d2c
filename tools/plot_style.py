"""How compared runs look: smoothed curves with seed bands, short legend labels, a colour and line
style per group, figure sizes.

tools/compare.py draws with these; tools/plots.py shares the figure sizes (STYLE, DPI).
"""

import json
import math

import numpy as np

BANDS = ('minmax', 'std', 'none')  # --band: the spread drawn around a group's mean across seeds


# --- Curves ---------------------------------------------------------------------------------------

def smooth(losses, spec):
  """'ema:0.9' (debiased exponential moving average, as TensorBoard's slider), a bare float in
  (0, 1) (EMA), 'ma:K' (trailing moving average of K points), or None/'none'/'0'."""
  if spec in (None, '', 'none', '0'):
    return losses
  kind, _, value = spec.partition(':')
  if not value:
    kind, value = 'ema', kind
  x = np.asarray(losses, np.float64)
  try:
    number = float(value) if kind == 'ema' else int(value)
  except ValueError:
    raise ValueError(f'--smooth={spec!r} is not valid; valid: ema:B (0 <= B < 1, or a bare B), '
                     'ma:K (an integer K >= 1), none') from None
  if kind == 'ema':
    beta = number
    if not 0.0 <= beta < 1.0:
      raise ValueError(f'--smooth: the EMA coefficient {beta} must be in [0, 1)')
    out, acc, weight = np.empty_like(x), 0.0, 0.0
    for i, v in enumerate(x):
      acc, weight = beta * acc + (1 - beta) * v, beta * weight + (1 - beta)
      out[i] = acc / weight
    return out
  if kind == 'ma':
    k = number
    if k < 1:
      raise ValueError(f'--smooth: the moving-average window {k} must be >= 1')
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(len(x))
    lo = np.maximum(0, idx - k + 1)
    return (c[idx + 1] - c[lo]) / (idx + 1 - lo)
  raise ValueError(f'--smooth={spec!r}: valid forms: ema:BETA, BETA, ma:K, none')


def band(curves, kind='minmax'):
  """Mean and spread across runs of (steps, losses) curves, on the union of their steps.

  A run missing a step (shorter, or stopped) or with a non-finite loss there does not count at that
  step.

  Args:
    curves: [(steps, losses)], one per run.
    kind: the spread: 'minmax' (lowest and highest run), 'std' (mean -/+ one standard deviation
      across runs) or 'none' (lo = hi = mean).

  Returns:
    (steps, mean, lo, hi) arrays.
  """
  if kind not in BANDS:
    raise ValueError(f'--band={kind!r}: valid values: {", ".join(BANDS)}')
  steps = np.unique(np.concatenate([s for s, _ in curves])) if curves else np.array([], np.int64)
  grid = np.full((len(curves), len(steps)), np.nan)  # [runs, steps]
  for i, (s, l) in enumerate(curves):
    grid[i, np.searchsorted(steps, s)] = np.where(np.isfinite(l), l, np.nan)
  keep = ~np.all(np.isnan(grid), 0)
  grid, steps = grid[:, keep], steps[keep]
  mean = np.nanmean(grid, 0)
  if kind == 'minmax':
    return steps, mean, np.nanmin(grid, 0), np.nanmax(grid, 0)
  if kind == 'std':
    std = np.nanstd(grid, 0)
    return steps, mean, mean - std, mean + std
  return steps, mean, mean, mean


# --- Legend labels, colours and line styles ------------------------------------------------------

MAX_LABEL = 40  # longer legend labels leave out each field's most common value, named once instead
SEPARATOR = ' · '
LINE_STYLES = ('-', '--', ':', '-.')  # --style_by takes a field of at most this many values
PALETTE = ('#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f',
           '#bcbd22', '#17becf')  # matplotlib's tab10: distinct hues, one per --color_by value
SHADE_RANGE = 0.45  # the darkest shade of a hue mixes in this much black, the lightest this white


def _num(value):
  """A number as short as it reads: 0.001 -> '1e-3', 0.0025 -> '2.5e-3', 0.05 -> '0.05'."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return str(value)
  if isinstance(value, int) or value == 0 or 1e-2 <= abs(value) < 1e5:
    return f'{value:g}'
  mantissa, exponent = f'{value:e}'.split('e')
  return f'{mantissa.rstrip("0").rstrip(".")}e{int(exponent)}'


def _count(value):
  """A count with k/M: 1000 -> '1k', 1500 -> '1.5k', 500 -> '500', 1234 -> '1234'."""
  if isinstance(value, bool) or not isinstance(value, int):
    return _num(value)
  for unit, size in (('M', 1_000_000), ('k', 1000)):
    if abs(value) >= size and value % (size // 10) == 0:
      return f'{value / size:g}{unit}'
  return str(value)


# How the common fields read in a legend; other fields read `name=value` (bools: `name`, `no name`).
ABBREVIATIONS = {
    'model.num_layers': lambda v: f'{v}L',
    'model.d_model': lambda v: f'd{v}',
    'model.d_ff': lambda v: f'ff {v}',
    'model.num_heads': lambda v: f'{v} heads',
    'model.num_kv_heads': lambda v: f'{v} kv heads',
    'model.dropout': lambda v: f'dropout {_num(v)}',
    'train.learning_rate': lambda v: f'lr {_num(v)}',
    'train.warmup_steps': lambda v: f'warmup {_count(v)}' if v else 'no warmup',
    'train.steps': lambda v: f'{_count(v)} steps',
    'train.batch_size': lambda v: f'batch {v}',
    'train.weight_decay': lambda v: f'wd {_num(v)}',
    'train.grad_clip_norm': lambda v: f'clip {_num(v)}' if v else 'no clip',
    'data.max_length': lambda v: f'L={v}',
}
# Fields whose values name themselves: `post`, `rope`, `swiglu`, `encoder_decoder`.
VALUE_ONLY = ('model.arch', 'model.attention', 'model.attention_impl', 'model.position',
              'model.norm', 'model.norm_position', 'model.ffn', 'train.schedule')


def abbreviate(field, value):
  """One field's value as a legend reads it: ('model.num_layers', 12) -> '12L'."""
  if field in ABBREVIATIONS:
    return ABBREVIATIONS[field](value)
  if field in VALUE_ONLY and isinstance(value, str):
    return value
  name = field.split('.')[-1]
  if isinstance(value, bool):
    return name if value else f'no {name}'
  return f'{name}={_num(value)}'


def legend_labels(configs, fields, flags=None, keep=(), max_len=MAX_LABEL):
  """Short legend labels: the values of the differing `fields`, abbreviated, then flag words.

  `post · 12L · lr 1e-3 · no warmup · plateau`. Where the fields of a label would take more than
  `max_len` characters (flag words come on top), each field outside `keep` (the colour and
  line-style fields, always shown) leaves out its most common value (one held by at least two
  groups), and the note names the left-out values once. Leaving out one value per field keeps
  distinct groups distinct; a group left with no field at all is named by its common values.

  Args:
    configs: one flat config per group.
    fields: the fields that differ between the groups, in label order.
    flags: per group, a list of flag words (`flag_words`), or None.
    keep: fields never left out.
    max_len: the most characters the fields of a label may take before values are left out.

  Returns:
    (labels, note): `note` is '' or 'unless noted: lr 2e-3 · 500 steps'.
  """
  flags = flags or [[] for _ in configs]
  parts = [[abbreviate(f, c.get(f)) for f in fields] for c in configs]
  full = [SEPARATOR.join(p) for p in parts]
  omit = {}
  if max(map(len, full), default=0) > max_len:
    for j, field in enumerate(fields):
      values = [p[j] for p in parts]
      common = max(values, key=values.count)  # ties: the first group's
      if field not in keep and values.count(common) >= 2:
        omit[field] = common
  labels = []
  for i, p in enumerate(parts):
    shown = [v for f, v in zip(fields, p) if omit.get(f) != v] or p
    labels.append(SEPARATOR.join(shown + list(flags[i])))
  return labels, ('unless noted: ' + SEPARATOR.join(omit.values()) if omit else '')


def _keys(configs, field):
  return [json.dumps(c.get(field), sort_keys=True) for c in configs]


def rank_fields(configs, fields):
  """`fields` in the order they should take colour, then line style.

  Fewest distinct values first (each must still split the groups: every field in `fields` differs).
  Among fields with as many values: the one with the most controlled contrasts (pairs of groups
  that differ in that field alone: the study's question), then the most even split, then `fields`
  order.
  """
  def key(field):
    values = _keys(configs, field)
    counts = [values.count(v) for v in set(values)]
    rest = [tuple(k) for k in zip(*(_keys(configs, f) for f in fields if f != field))] or [
        ()] * len(configs)
    contrasts = sum(rest[i] == rest[j] for i in range(len(configs))
                    for j in range(i + 1, len(configs)))
    return len(counts), -contrasts, -min(counts) / max(counts), fields.index(field)
  return sorted(fields, key=key)


def resolve_field(name, fields, option):
  """The differing field `name` names (dotted, or its last part where unambiguous); None for
  'none'."""
  if name in ('none', ''):
    return None
  matches = [f for f in fields if f == name] or [f for f in fields if f.split('.')[-1] == name]
  if len(matches) != 1:
    raise ValueError(f'--{option}={name}: not a field that differs between the runs; fields that '
                     f'differ: {", ".join(fields) or "none"}; or none (no field)')
  return matches[0]


def choose_style_fields(configs, fields, color_by=None, style_by=None):
  """(colour field, line-style field) of a comparison, either None.

  Args:
    configs: one flat config per group.
    fields: the fields that differ between the groups.
    color_by: a field, 'none', or None for the first of `rank_fields`.
    style_by: a field, 'none', or None for the next ranked field of at most len(LINE_STYLES)
      values, when colour alone does not tell the groups apart.

  Returns:
    (color_field, style_field).

  Raises:
    ValueError: a named field does not differ, or the style field has too many values.
  """
  ranked = rank_fields(configs, fields)
  if color_by is None:
    color = ranked[0] if ranked else None
  else:
    color = resolve_field(color_by, fields, 'color_by')
  if style_by is None:
    separated = color is not None and len(set(_keys(configs, color))) == len(configs)
    style = next((f for f in ranked if f != color
                  and len(set(_keys(configs, f))) <= len(LINE_STYLES)), None)
    style = None if separated else style
  else:
    style = resolve_field(style_by, fields, 'style_by')
    n = len(set(_keys(configs, style))) if style else 0
    if n > len(LINE_STYLES):
      raise ValueError(f'--style_by={style_by}: {n} values, but line styles tell at most '
                       f'{len(LINE_STYLES)} apart; colour by it instead (--color_by)')
  return color, style


def _natural(values):
  """A sort key for tuples of config values: numbers by size, then everything else as text."""
  return tuple((0, v, '') if isinstance(v, (int, float)) and not isinstance(v, bool)
               else (1, 0, json.dumps(v, sort_keys=True)) for v in values)


def _mix(rgb, t):
  """`rgb` darkened (t < 0, towards black) or lightened (t > 0, towards white) by |t|."""
  rgb = np.asarray(rgb, np.float64)
  return tuple(rgb * (1 + t) if t < 0 else rgb + (1 - rgb) * t)


def assign_styles(configs, fields, color_field=None, style_field=None):
  """Colour and line style of each group.

  Each value of `color_field` gets a hue (matplotlib's tab10), each value of `style_field` a line
  style (LINE_STYLES), both in the values' natural order (numbers by size, then text). The other
  differing fields give the shade of the hue, from dark to light in their natural order, the same
  shade for the same values under every hue: matched pairs (Post-LN and Pre-LN of one setting) are
  as dark as each other. Without a colour field every group gets its own hue.

  Returns:
    One dict per group: 'color' (an RGB tuple), 'linestyle', and the indices 'hue', 'style',
    'shade'.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  from matplotlib import colors as mcolors  # pylint: disable=g-import-not-at-top
  n = len(configs)

  def index(fields_of):  # each group's rank among the fields' values in natural order (6L < 12L)
    values = [tuple(c.get(f) for f in fields_of) for c in configs]
    keys = [json.dumps(v, sort_keys=True) for v in values]  # lists in configs are not hashable
    order = [json.dumps(v, sort_keys=True) for v in sorted(
        {k: v for k, v in zip(keys, values)}.values(), key=_natural)]
    return [order.index(k) for k in keys], len(order)

  hue, num_hues = index([color_field]) if color_field else (list(range(n)), n)
  style, _ = index([style_field] if style_field else [])
  # Without a colour field every group has its own hue, so the shade stays at the base colour.
  rest = [f for f in fields if f not in (color_field, style_field)] if color_field else []
  shades, num_shades = index(rest)
  if num_hues <= len(PALETTE):
    bases = [mcolors.to_rgb(c) for c in PALETTE[:num_hues]]
  else:
    bases = [matplotlib.colormaps['viridis'](x)[:3] for x in np.linspace(0, 0.9, num_hues)]
  out = []
  for i in range(n):
    shade = shades[i]
    t = 0.0 if num_shades == 1 else -SHADE_RANGE + 2 * SHADE_RANGE * shade / (num_shades - 1)
    out.append({'color': _mix(bases[hue[i]], t), 'linestyle': LINE_STYLES[style[i]],
                'hue': hue[i], 'style': style[i], 'shade': shade})
  return out


# --- Figure sizes ---------------------------------------------------------------------------------

# Sizes for a figure 9 inches wide shown at about 900 px (the README's width): 10 pt text is 14 px.
STYLE = {'font.size': 10, 'axes.titlesize': 11, 'axes.labelsize': 10, 'legend.fontsize': 9.5,
         'legend.title_fontsize': 9.5, 'xtick.labelsize': 9, 'ytick.labelsize': 9,
         'lines.linewidth': 1.7, 'axes.spines.top': False, 'axes.spines.right': False}
WIDTH = 9.0  # inches
DPI = 150  # the PNG is 1350 px wide: sharp when scaled down to 900 px


def pyplot():
  """matplotlib.pyplot on the Agg backend, matplotlib's font notices silenced."""
  import logging  # pylint: disable=g-import-not-at-top
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  # absl routes matplotlib's one-line-per-font fallback notices to stderr: keep the table readable.
  logging.getLogger('matplotlib.font_manager').setLevel(logging.ERROR)
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def plain_log_axis(axis):
  """A log scale whose ticks read as plain numbers (2, 3, 4, 6) rather than 2x10^0."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  if axis.axis_name == 'y':
    axis.axes.set_yscale('log')
    lo, hi = axis.axes.get_ylim()
  else:
    axis.axes.set_xscale('log')
    lo, hi = axis.axes.get_xlim()
  decades = math.log10(hi / lo) if lo > 0 and hi > lo else 1.0
  # Under 1.5 decades (a loss from 6 to 1.2) label 1, 1.5, 2, 3, 4, 6; wider ranges fewer.
  subs = ((1.0, 1.5, 2.0, 3.0, 4.0, 6.0) if decades < 1.5 else
          (1.0, 2.0, 5.0) if decades < 3 else (1.0,))
  axis.set_major_locator(ticker.LogLocator(base=10, subs=subs))
  axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f'{v:g}'))
  axis.set_minor_formatter(ticker.NullFormatter())
