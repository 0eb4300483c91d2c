"""The whole workflow against object storage: a local GCS emulator (gcp-storage-emulator, from the
test extras) on loopback stands in for gs://, so that nothing reaches the internet.

The clients are pointed at it by their own settings: STORAGE_EMULATOR_HOST (google-cloud-storage
and gcsfs, hence etils.epath and the workdir lock), TENSORSTORE_GCS_HTTP_URL and a fixed test token
(tensorstore, hence Orbax). The emulator honours the generation preconditions of uploads and
deletes (tests.helpers.GCS_LAUNCHER); the lock's own cases are in test_gcs_lock.py and
tests/unit/test_object_lock.py.
"""

import io
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, gcs_emulator, quick_config, sigterm_after
from training import lock
from training import loop
from training import paths
from training import writers

RUN, DATA = 'gs://bucket/run', 'gs://bucket/data'


@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
  """An in-memory emulator with the bucket `bucket`; the environment points every client at it
  (this process and the train.py / eval.py processes it starts)."""
  # tensorstore (hence Orbax) is pointed at it by its own settings and sends a fixed token.
  with gcs_emulator(TENSORSTORE_GCS_HTTP_URL='{url}', GOOGLE_AUTH_TOKEN_FOR_TESTING='emulator',
                    TENSORSTORE_GCS_REQUEST_CONCURRENCY='8',
                    ATTNLAB_DATA_CACHE=str(tmp_path_factory.mktemp('data_cache'))) as url:
    yield url


def steps_of(workdir, split='train'):
  rows = writers.read_metrics(paths.join(workdir, 'metrics.jsonl'))
  return [r['step'] for r in rows if r['split'] == split]


def test_train_stop_resume_from_a_damaged_newest_checkpoint_and_eval_on_gs(gcs, capfd):
  # Train; SIGTERM after step 3 saves there and stops (the handler of a real signal).
  config = quick_config(DATA, steps=6, checkpoint_every=2, log_every=1, eval_every=3)
  with pytest.raises(loop.Stopped):
    loop.train_and_evaluate(config, RUN, hooks=[sigterm_after(3)])
  assert paths.listdir(paths.join(RUN, 'checkpoints')) == ['2', '3']
  assert steps_of(RUN) == [1, 2, 3]  # object storage: written whole before each checkpoint
  assert not paths.exists(paths.join(RUN, 'lock'))  # released
  assert paths.listdir(paths.join(DATA, 'toy_translation', 'base'))  # the data went up too

  # A second run on a workdir in use is refused, naming the holder.
  with lock.WorkdirLock(RUN):
    with pytest.raises(lock.WorkdirBusy, match=f'in use by PID {os.getpid()} on '):
      loop.train_and_evaluate(config, RUN)

  # The newest checkpoint damaged (its arrays gone), the same command falls back to the previous
  # one, moves the damaged one aside and resumes; the rows are whole, TensorBoard's events there.
  # (One run for both: each run compiles anew, and the integration tier's time counts.)
  state_dir = paths.join(RUN, 'checkpoints', '3', 'state')
  for name in paths.listdir(state_dir):
    if name != '_METADATA':
      paths.remove(paths.join(state_dir, name))
  capfd.readouterr()
  loop.train_and_evaluate(config, RUN)
  err = capfd.readouterr().err
  assert 'checkpoint step 3' in err and 'unreadable' in err and 'resumed from step 2' in err, err
  assert any(n.startswith('corrupt-3-') for n in paths.listdir(paths.join(RUN, 'checkpoints')))
  assert steps_of(RUN) == [1, 2, 3, 4, 5, 6] and steps_of(RUN, 'valid') == [3, 6]
  assert any(n.startswith('events.out.tfevents') for n in paths.listdir(RUN))

  # eval.py on the gs:// workdir writes eval.json and the loss curve there.
  out = subprocess.run([sys.executable, 'eval.py', f'--workdir={RUN}', '--split=validation',
                        '--max_examples=4'], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert paths.read_json(paths.join(RUN, 'eval.json'))['loss']['validation'] > 0
  assert paths.read_bytes(paths.join(RUN, 'loss_curve.png'))[:4] == b'\x89PNG'


def test_a_two_cell_sweep_and_its_comparison_on_gs(gcs, tmp_path):
  from tools.compare import comparison as compare
  from tools.sweep import runner as sweep_runner
  spec = tmp_path / 'gs_sweep.py'
  spec.write_text(f'''
from configs import decoder_only


def get_config(arg=None):
  config = decoder_only.get_config('quick')
  config.data.data_dir = {DATA!r}
  config.train.update(steps=2, warmup_steps=0, log_every=1, eval_every=2, checkpoint_every=2)
  return config


def get_sweep():
  return {{'grid': {{'model.num_layers': [1, 2]}}, 'seeds': [0]}}
''')
  sweep_dir = 'gs://bucket/sweep'
  out = io.StringIO()
  results = sweep_runner.run_sweep(str(spec), sweep_dir, parallel=2, out=out)
  assert sorted(results.values()) == ['done', 'done'], out.getvalue()
  cells = paths.listdir(sweep_dir)
  assert len(cells) == 2, cells
  assert all(paths.exists(paths.join(sweep_dir, c, 'train.log')) for c in cells)
  png = paths.join(sweep_dir, 'compare.png')
  table = compare.compare([sweep_dir], png)
  assert paths.read_bytes(png)[:4] == b'\x89PNG'
  assert table.count('\n') >= 3, table
