"""Short legend labels of compared groups: `post · 12L · lr 1e-3 · no warmup · plateau`."""

MAX_LABEL = 40  # longer legend labels leave out each field's most common value, named once instead
SEPARATOR = ' · '


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
    'model.num_kv_heads': lambda v: f'{v} kv head{"" if v == 1 else "s"}',
    'model.dropout': lambda v: f'dropout {_num(v)}',
    'train.learning_rate': lambda v: f'lr {_num(v)}',
    'train.warmup_steps': lambda v: f'warmup {_count(v)}' if v else 'no warmup',
    'train.steps': lambda v: f'{_count(v)} steps',
    'train.batch_size': lambda v: f'batch {v}',
    'train.weight_decay': lambda v: f'wd {_num(v)}',
    'train.grad_clip_norm': lambda v: f'clip {_num(v)}' if v else 'no clip',
    'data.max_length': lambda v: f'L={v}',
    'model.random_positions_max': lambda v: f'random ids < {_count(v)}' if v else '',
    'model.moe_experts': lambda v: f'{v} experts' if v else 'dense',
    'model.moe_d_ff': lambda v: f'expert ff {v}' if v else '',
    'model.moe_top_k': lambda v: f'top-{v}',
    'model.moe_capacity_factor': lambda v: f'C {_num(v)}' if v else 'C 0 (dropless)',
    'model.moe_aux_loss': lambda v: f'aux {_num(v)}' if v else 'no aux loss',
    'model.moe_bias_rate': lambda v: f'bias {_num(v)}' if v else '',
    'model.moe_shared_experts': lambda v: f'{v} shared' if v else '',
    'model.moe_routing': lambda v: 'expert choice' if v == 'experts' else 'token choice',
    'model.final_logit_softcap': lambda v: f'softcap {_num(v)}' if v else 'no softcap',
    'train.z_loss': lambda v: f'z-loss {_num(v)}' if v else 'no z-loss',
    'model.rope_scaling': lambda v: f'{v} scaling' if v != 'none' else 'no scaling',
    'model.rope_scaling_factor': lambda v: f'x{_num(v)}' if v != 1 else '',
    # A fine-tune: from the source run's workdir name (its cell, in a sweep).
    'train.init_from': lambda v: f'from {str(v).rstrip("/").rsplit("/", 1)[-1]}' if v else '',
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


def _part(field, config):
  """A group's value of `field` abbreviated; as many KV heads as query heads is plain multi-head
  attention and reads as nothing (linear attention, which has no KV heads to share, would read
  '4 kv heads' beside GQA's '2 kv heads')."""
  value = config.get(field)
  if field == 'model.num_kv_heads' and value == config.get('model.num_heads'):
    return ''
  return abbreviate(field, value)


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
    flags: per group, a list of flag words (`tools.compare.summary.flag_words`), or None.
    keep: fields never left out.
    max_len: the most characters the fields of a label may take before values are left out.

  Returns:
    (labels, note): `note` is '' or 'unless noted: lr 2e-3 · 500 steps'.
  """
  flags = flags or [[] for _ in configs]
  parts = [[_part(field, config) for field in fields] for config in configs]
  longest = max((len(SEPARATOR.join(p)) for p in parts), default=0)
  omit = _common_values(fields, parts, keep) if longest > max_len else {}
  labels = []
  for part, words in zip(parts, flags):
    shown = [value for field, value in zip(fields, part) if omit.get(field) != value] or part
    labels.append(SEPARATOR.join([v for v in shown if v] + list(words)))  # '' reads as nothing
  note = 'unless noted: ' + SEPARATOR.join(v for v in omit.values() if v) if omit else ''
  return labels, note


def _common_values(fields, parts, keep):
  """{field: its most common abbreviated value} of the fields outside `keep` whose most common
  value is held by at least two groups (ties: the first group's)."""
  common = {}
  for j, field in enumerate(fields):
    values = [part[j] for part in parts]
    most = max(values, key=values.count)
    if field not in keep and values.count(most) >= 2:
      common[field] = most
  return common
