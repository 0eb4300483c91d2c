"""The colour and line style of each compared group: which fields pick them, and the shades.

The colour follows one field (--color_by), the line style another (--style_by), and the other
differing fields the shade of the colour (tools/compare/__main__.py's docstring).
"""

import json

import numpy as np

LINE_STYLES = ('-', '--', ':', '-.')  # --style_by takes a field of at most this many values
PALETTE = ('#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f',
           '#bcbd22', '#17becf')  # matplotlib's tab10: distinct hues, one per --color_by value
SHADE_RANGE = 0.45  # the darkest shade of a hue mixes in this much black, the lightest this white


def _keys(configs, field):
  """Each group's value of `field` as JSON text (config values may be unhashable lists)."""
  return [json.dumps(c.get(field), sort_keys=True) for c in configs]


# --- Which fields pick the colour and the line style ---------------------------------------------

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
    contrasts = _controlled_contrasts(configs, fields, field)
    return len(counts), -contrasts, -min(counts) / max(counts), fields.index(field)
  return sorted(fields, key=key)


def _controlled_contrasts(configs, fields, field):
  """The pairs of groups whose values of every field of `fields` but `field` are the same."""
  others = [f for f in fields if f != field]
  if others:
    rest = list(zip(*(_keys(configs, f) for f in others)))
  else:
    rest = [()] * len(configs)
  n = len(configs)
  return sum(rest[i] == rest[j] for i in range(n) for j in range(i + 1, n))


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
    return color, _automatic_style_field(configs, ranked, color)
  style = resolve_field(style_by, fields, 'style_by')
  n = len(set(_keys(configs, style))) if style else 0
  if n > len(LINE_STYLES):
    raise ValueError(f'--style_by={style_by}: {n} values, but line styles tell at most '
                     f'{len(LINE_STYLES)} apart; colour by it instead (--color_by)')
  return color, style


def _automatic_style_field(configs, ranked, color):
  """The first ranked field of at most len(LINE_STYLES) values besides the colour's; None when
  the colour alone tells every group apart."""
  if color is not None and len(set(_keys(configs, color))) == len(configs):
    return None
  for field in ranked:
    if field != color and len(set(_keys(configs, field))) <= len(LINE_STYLES):
      return field
  return None


# --- Colours, shades and line styles --------------------------------------------------------------

def _natural(values):
  """A sort key for tuples of config values: numbers by size, then everything else as text."""
  return tuple((0, v, '') if isinstance(v, (int, float)) and not isinstance(v, bool)
               else (1, 0, json.dumps(v, sort_keys=True)) for v in values)


def _value_ranks(configs, fields):
  """Each group's rank among the distinct values of `fields` in natural order (6L < 12L), and
  the number of distinct values."""
  values = [tuple(c.get(f) for f in fields) for c in configs]
  keys = [json.dumps(v, sort_keys=True) for v in values]  # lists in configs are not hashable
  distinct = dict(zip(keys, values))
  order = [json.dumps(v, sort_keys=True) for v in sorted(distinct.values(), key=_natural)]
  return [order.index(k) for k in keys], len(order)


def _mix(rgb, t):
  """`rgb` darkened (t < 0, towards black) or lightened (t > 0, towards white) by |t|."""
  rgb = np.asarray(rgb, np.float64)
  return tuple(rgb * (1 + t) if t < 0 else rgb + (1 - rgb) * t)


def _base_colors(num_hues):
  """RGB of each hue: the palette's, or evenly spaced viridis colours beyond its length."""
  import matplotlib
  from matplotlib import colors as mcolors
  if num_hues <= len(PALETTE):
    return [mcolors.to_rgb(c) for c in PALETTE[:num_hues]]
  return [matplotlib.colormaps['viridis'](x)[:3] for x in np.linspace(0, 0.9, num_hues)]


def _shade(rank, num_shades):
  """How far a shade mixes its hue with black (< 0) or white (> 0): dark to light by rank."""
  if num_shades == 1:
    return 0.0
  return -SHADE_RANGE + 2 * SHADE_RANGE * rank / (num_shades - 1)


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
  n = len(configs)
  if color_field:
    hues, num_hues = _value_ranks(configs, [color_field])
  else:
    hues, num_hues = list(range(n)), n
  styles, _ = _value_ranks(configs, [style_field] if style_field else [])
  # Without a colour field every group has its own hue, so the shade stays at the base colour.
  if color_field:
    rest = [f for f in fields if f not in (color_field, style_field)]
  else:
    rest = []
  shades, num_shades = _value_ranks(configs, rest)
  bases = _base_colors(num_hues)
  out = []
  for hue, style, shade in zip(hues, styles, shades):
    out.append({'color': _mix(bases[hue], _shade(shade, num_shades)),
                'linestyle': LINE_STYLES[style], 'hue': hue, 'style': style, 'shade': shade})
  return out
