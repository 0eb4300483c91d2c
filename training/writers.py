"""Where a run's records go: metrics.jsonl and TensorBoard (process 0 only), small JSON files.

metrics.jsonl is strict JSON, one object a line: a non-finite value is written as null and named,
with its value as text, under "nonfinite" (`{"loss": null, "nonfinite": {"loss": "nan"}}`);
`read_metrics` turns it back into a float. It is only ever appended to, or rewritten whole into a
temporary file that is renamed in, so a kill at any moment leaves either the old file or the new
one, and at worst a torn last line, which `read_metrics` skips with a warning.
"""

import json
import math
import os
import sys


def write_json(path, obj):
  """Writes `obj` to `path` atomically (a temporary file renamed in)."""
  with open(path + '.tmp', 'w') as f:
    json.dump(obj, f, indent=2)
  os.replace(path + '.tmp', path)


def encode_row(row):
  """One metrics.jsonl line (strict JSON: non-finite floats as null, named under 'nonfinite')."""
  bad = {k: repr(v) for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
  if bad:
    row = {**{k: (None if k in bad else v) for k, v in row.items()}, 'nonfinite': bad}
  return json.dumps(row, allow_nan=False) + '\n'


def decode_row(line):
  row = json.loads(line)
  for key, text in row.pop('nonfinite', {}).items():
    row[key] = float(text)
  return row


def read_metrics(path, warn=True):
  """The rows of a metrics.jsonl, in order, with non-finite values restored as floats.

  A torn last line (a run killed while writing it) is skipped, with one warning; any other line
  that is not a JSON object with a 'step' is a ValueError naming its line number.
  """
  with open(path) as f:
    lines = f.read().split('\n')
  complete = lines[-1] == ''  # a file of whole lines ends with a newline
  lines = lines[:-1] if complete else lines
  rows = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      row = decode_row(line)
      if not isinstance(row, dict) or 'step' not in row:
        raise ValueError('not a metrics row')
    except ValueError as e:
      if number == len(lines) and not complete:
        if warn:
          print(f'warning: {path}: skipped its torn last line {number} (a run stopped while '
                'writing it)', file=sys.stderr)
        break
      raise ValueError(f'{path}: line {number} is not a metrics row ({e}): {line[:80]!r}') from None
    rows.append(row)
  return rows


class NullWriter:
  """The MetricsWriter of processes other than 0."""

  def write(self, step, split, metrics):
    pass

  def close(self):
    pass


class MetricsWriter:
  """Appends metrics to metrics.jsonl and TensorBoard; on resume, drops rows after the restart step."""

  def __init__(self, workdir, resume_step):
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    self.path = os.path.join(workdir, 'metrics.jsonl')
    if os.path.exists(self.path):
      rows = [r for r in read_metrics(self.path) if r['step'] <= resume_step]
      with open(self.path + '.tmp', 'w') as f:  # a kill here leaves the old file whole
        f.writelines(encode_row(r) for r in rows)
        f.flush()
        os.fsync(f.fileno())
      os.replace(self.path + '.tmp', self.path)
    self.file = open(self.path, 'a')
    self.tb = SummaryWriter(workdir, purge_step=resume_step + 1 if resume_step else None)

  def write(self, step, split, metrics):
    self.file.write(encode_row({'step': step, 'split': split, **metrics}))
    self.file.flush()
    for key, value in metrics.items():
      self.tb.add_scalar(f'{split}/{key}', value, step)

  def close(self):
    self.file.close()
    self.tb.close()


