"""Where a run's records go: metrics.jsonl and TensorBoard (process 0 only), small JSON files.

metrics.jsonl is strict JSON, one object a line: a non-finite value is written as null and named,
with its value as text, under "nonfinite" (`{"loss": null, "nonfinite": {"loss": "nan"}}`);
`read_metrics` turns it back into a float. Locally it is only ever appended to, or rewritten whole
into a temporary file that is renamed in, so a kill at any moment leaves either the old file or the
new one, and at worst a torn last line, which `read_metrics` skips with a warning. On object storage
(a gs:// workdir), which cannot append, the object is rewritten whole (`MetricsWriter.flush`).
"""

import json
import math
import os
import shutil
import sys
import tempfile
import time

from training import paths


def write_json(path, obj):
  """Writes `obj` to `path` (local or gs://) atomically."""
  paths.write_json(path, obj)


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


def read_metrics(path, warn=True, bad_lines=None):
  """The rows of a metrics.jsonl, in order, with non-finite values restored as floats.

  A torn last line (a run killed while writing it) is skipped, with one warning; any other line
  that is not a JSON object with a 'step' is a ValueError naming its line number, or, given a list
  `bad_lines`, skipped and its number appended there.
  """
  lines = paths.read_text(path).split('\n')
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
      if bad_lines is None:
        raise ValueError(f'{path}: line {number} is not a metrics row ({e}): '
                         f'{line[:80]!r}') from None
      bad_lines.append(number)
      continue
    rows.append(row)
  return rows


def resumed_rows(path, resume_step):
  """The rows a resumed run keeps: those up to its checkpoint, one per (step, split) (the last
  written wins, in the place of the first). Lines that cannot be read are left out: the file as
  it was is kept beside it as
  `metrics.jsonl.corrupt-<time>`, with a one-line warning."""
  bad = []
  rows = read_metrics(path, bad_lines=bad)
  if bad:
    aside = f'{path}.corrupt-{int(time.time())}'
    paths.write_text(aside, paths.read_text(path))
    print(f'warning: {path}: line{"s" if len(bad) > 1 else ""} '
          f'{", ".join(map(str, bad[:5]))}{" ..." if len(bad) > 5 else ""} could not be read and '
          f'{"are" if len(bad) > 1 else "is"} left out; the file as it was is kept as '
          f'{paths.basename(aside)}', file=sys.stderr)
  last = {(r['step'], r.get('split')): r for r in rows if r['step'] <= resume_step}
  kept = []  # in the order of each (step, split)'s first row, with its last row's values
  for r in rows:
    key = (r['step'], r.get('split'))
    if key in last:
      kept.append(last.pop(key))
  return kept


class NullWriter:
  """The MetricsWriter of processes other than 0."""

  def write(self, step, split, metrics):
    pass

  def flush(self):
    pass

  def close(self):
    pass


class MetricsWriter:
  """Writes metrics to metrics.jsonl and TensorBoard; on resume, drops rows after the restart step.

  Locally each row is appended and flushed at once. On object storage the rows are kept in memory
  and the whole object is rewritten by `flush`: the loop calls it before every checkpoint, so that,
  as locally, a killed run loses no row before its last checkpoint; rows are also written at most
  `flush_secs` after they are logged, and at close. TensorBoard's event files are written to a
  local folder and copied whole at the same moments (tensorboardX's own gs:// writer re-uploads
  from its finalizer, which blocks interpreter exit for minutes when the store is unreachable).
  """

  def __init__(self, workdir, resume_step, flush_secs=30.0):
    from tensorboardX import SummaryWriter
    self.workdir, self.path = workdir, paths.join(workdir, 'metrics.jsonl')
    self.remote, self.flush_secs = paths.is_remote(self.path), flush_secs
    rows = []
    if paths.exists(self.path):
      rows = resumed_rows(self.path, resume_step)
      paths.write_text(self.path, ''.join(map(encode_row, rows)))  # a kill leaves the old whole
    elif resume_step:
      print(f'warning: {self.path} is missing (deleted?): the rows up to the checkpoint, step '
            f'{resume_step}, are lost; the rows after it are written', file=sys.stderr)
    # Every row of the file: object storage rewrites it whole; locally it is written again if the
    # file is deleted while the run goes on.
    self.lines = [encode_row(r) for r in rows]
    self.dirty, self.flushed = False, time.monotonic()
    self.file = None if self.remote else open(self.path, 'a')
    self.events = tempfile.mkdtemp(prefix='attnlab_events_') if self.remote else None
    self.tb = SummaryWriter(self.events or workdir,
                            purge_step=resume_step + 1 if resume_step else None)

  def write(self, step, split, metrics):
    line = encode_row({'step': step, 'split': split, **metrics})
    self.lines.append(line)
    if self.remote:
      self.dirty = True
    else:
      if not os.path.exists(self.path):  # deleted under the run: the open file is unlinked
        print(f'warning: {self.path} was deleted while the run wrote it; writing it again with '
              'every row of the run', file=sys.stderr)
        self.file.close()
        paths.write_text(self.path, ''.join(self.lines[:-1]))
        self.file = open(self.path, 'a')
      self.file.write(line)
      self.file.flush()
    for key, value in metrics.items():
      self.tb.add_scalar(f'{split}/{key}', value, step)
    if self.remote and time.monotonic() - self.flushed >= self.flush_secs:
      self.flush()

  def flush(self):
    """Makes every row written so far durable (object storage: rewrites the objects)."""
    if self.remote and self.dirty:
      paths.write_text(self.path, ''.join(self.lines))
      self.tb.flush()
      for name in os.listdir(self.events):
        with open(os.path.join(self.events, name), 'rb') as f:
          paths.write_bytes(paths.join(self.workdir, name), f.read())
      self.dirty, self.flushed = False, time.monotonic()

  def close(self):
    if self.file is not None:
      self.file.close()
    self.tb.close()
    self.flush()
    if self.events:
      shutil.rmtree(self.events, ignore_errors=True)
