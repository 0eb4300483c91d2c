"""train.keep_checkpoints: a run keeps exactly its newest K checkpoints, and rotation never leaves
the checkpoints folder without a readable one: not while the run trains, and not when a resumed
run with a smaller K starts from an older checkpoint because the newest is damaged."""

import os

import pytest

from tests.helpers import metric_rows, quick_config
from training import callbacks
from training import checkpointing
from training import loop


def _config(data_dir, steps, keep):
  return quick_config(data_dir, steps=steps, checkpoint_every=2, keep_checkpoints=keep,
                      eval_every=100, warmup_steps=0, log_every=1)


def _steps(workdir):
  """The committed checkpoint steps in WORKDIR/checkpoints (Orbax writes a step under a temporary
  name and renames it when complete; a damaged one moved aside is `corrupt-<step>-<time>`)."""
  directory = os.path.join(workdir, 'checkpoints')
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(name) for name in names if name.isdigit())


def _newest_readable(workdir, config, state):
  """The step a resume would start from: the newest checkpoint whose every item restores into
  `state`'s structure (None: none is readable). Nothing is moved aside."""
  mngr = None
  try:
    mngr = checkpointing.checkpoint_manager(workdir, config)
    restored = checkpointing.restore_newest_good(mngr, state, workdir, move_aside=False)
  except (checkpointing.UnreadableCheckpoints, FileNotFoundError):  # (removed while listed)
    return None
  finally:
    if mngr is not None:
      mngr.close()
  return None if restored is None else restored[2]


class Watch(callbacks.Callback):
  """A training hook that checks, before and after every step, that once a checkpoint has been
  written the checkpoints folder holds a readable one, and never more than `keep` + 1 (the newest
  is committed before the oldest is removed). Before a step is the moment right after the previous
  step's save was started (written in the background): a rotation that removed the old checkpoint
  before the new one was complete would show there. Records (step, 'before' or 'after', the
  committed steps, the newest readable one)."""

  def __init__(self, workdir, config, keep):
    self.workdir, self.config, self.keep = workdir, config, keep
    self.seen = []
    self.written = bool(_steps(workdir))

  def _check(self, step, when, state):
    steps = _steps(self.workdir)
    while True:
      self.written = self.written or bool(steps)
      good = _newest_readable(self.workdir, self.config, state) if self.written else None
      # The folder as it was through the whole check: a save committed (and the old checkpoint
      # removed) while a step was being read is seen by the next try.
      steps, listed = _steps(self.workdir), steps
      if steps == listed:
        break
    self.seen.append((step, when, steps, good))
    assert not self.written or good is not None, self.seen
    assert len(steps) <= self.keep + 1, self.seen

  def before_step(self, step, record):
    self._check(step, 'before', record.state)

  def at_step(self, step, record):
    self._check(step, 'after', record.state)

  def after(self):
    """(step, committed steps, newest readable) after every step."""
    return [(step, steps, good) for step, when, steps, good in self.seen if when == 'after']


@pytest.mark.parametrize('keep', [1, 2])
def test_a_run_keeps_exactly_its_newest_checkpoints(data_dir, tmp_path, keep):
  workdir = str(tmp_path)
  config = _config(data_dir, 8, keep)  # checkpoints at steps 2, 4, 6 and 8
  watch = Watch(workdir, config, keep)
  loop.train_and_evaluate(config, workdir, hooks=[watch])
  assert _steps(workdir) == [2, 4, 6, 8][-keep:]
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == [str(s) for s in [2, 4, 6, 8][-keep:]]
  assert [step for step, _, _ in watch.after()] == list(range(1, 9))
  # From the first checkpoint on, every check found one to resume from, never an older one than
  # the check before.
  goods = [good for _, _, steps, good in watch.seen if steps]
  assert goods and None not in goods and goods == sorted(goods), watch.seen


def _truncate(step_dir):
  """Damages a checkpoint as a failing disk would: every file over 64 bytes cut to a third."""
  for d, _, files in os.walk(step_dir):
    for name in files:
      path = os.path.join(d, name)
      if os.path.getsize(path) > 64:
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 3)


def test_a_smaller_keep_never_removes_the_only_readable_checkpoint(data_dir, tmp_path, capsys):
  """Checkpoints 2 and 4 (K = 2), 4 damaged; resumed with K = 1, the run falls back to 2 and keeps
  it until a newer one is committed: at every step some checkpoint is readable."""
  workdir = str(tmp_path)
  loop.train_and_evaluate(_config(data_dir, 4, 2), workdir)
  assert _steps(workdir) == [2, 4]
  _truncate(tmp_path / 'checkpoints' / '4')
  config = _config(data_dir, 8, 1)
  assert _newest_readable(workdir, config, _state_of(config)) == 2
  capsys.readouterr()
  watch = Watch(workdir, config, 1)
  loop.train_and_evaluate(config, workdir, hooks=[watch])
  err = capsys.readouterr().err
  assert f'train: resumed from step 2 in {workdir}' in err, err
  assert 'checkpoint step 4' in err and 'unreadable' in err, err
  assert [step for step, _, _ in watch.after()] == list(range(3, 9))
  # Step 2, the only readable checkpoint, stays until the new step 4 is committed.
  assert watch.after()[:2] == [(3, [2], 2), (4, [2], 2)], watch.seen
  assert _steps(workdir) == [8]
  assert _newest_readable(workdir, config, _state_of(config)) == 8
  corrupt = [n for n in os.listdir(tmp_path / 'checkpoints') if not n.isdigit()]
  assert len(corrupt) == 1 and corrupt[0].startswith('corrupt-4-'), corrupt  # kept, not rotated
  assert [r['step'] for r in metric_rows(tmp_path)] == list(range(1, 9))


def _state_of(config):
  """A fresh training state of `config` (the structure a checkpoint restores into)."""
  from data import pipeline
  import models
  from training import state as state_lib
  tokenizer = pipeline.get_tokenizer(config.data)
  _, _, state = state_lib.create_state(
      config, state_lib.model_vocab_size(config, tokenizer.vocab_size),
      special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  return state
