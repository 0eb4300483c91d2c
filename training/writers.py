"""Where a run's records go: metrics.jsonl and TensorBoard (process 0 only), small JSON files."""

import json
import os


def write_json(path, obj):
  """Writes `obj` to `path` atomically (a temporary file renamed in)."""
  with open(path + '.tmp', 'w') as f:
    json.dump(obj, f, indent=2)
  os.replace(path + '.tmp', path)


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
      with open(self.path) as f:
        rows = [line for line in f if line.strip() and json.loads(line)['step'] <= resume_step]
      with open(self.path, 'w') as f:
        f.writelines(rows)
    self.file = open(self.path, 'a')
    self.tb = SummaryWriter(workdir, purge_step=resume_step + 1 if resume_step else None)

  def write(self, step, split, metrics):
    self.file.write(json.dumps({'step': step, 'split': split, **metrics}) + '\n')
    self.file.flush()
    for key, value in metrics.items():
      self.tb.add_scalar(f'{split}/{key}', value, step)

  def close(self):
    self.file.close()
    self.tb.close()


