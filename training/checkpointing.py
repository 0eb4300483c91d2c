"""Orbax checkpoints of the training state and the data position, and the checks before a resume."""

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback

import jax
import numpy as np
import orbax.checkpoint as ocp

from configs import default as default_config
from training import paths


# tensorstore (Orbax's storage) retries a failed object-store request 32 times, backing off to 32 s
# between tries: an in-flight checkpoint write waits out an outage for a quarter of an hour before
# it fails. Bounded here to about half a minute (1 + 2 + 4 + 8 + 8 + 8 s), as gcsfs's own retries
# (6 tries over about 35 s): then the run ends in one line naming the store and the last good
# checkpoint (training.loop.store_lost), and the same command resumes once the store is back.
STORE_RETRIES = {'max_retries': 6, 'initial_delay': '1s', 'max_delay': '8s'}


def _bound_store_retries():
  """Puts `STORE_RETRIES` into every tensorstore context Orbax creates (it has no argument for
  it): the GCS and S3 drivers read `gcs_request_retries` / `s3_request_retries` from there."""
  from orbax.checkpoint._src.serialization import tensorstore_utils
  for context in (tensorstore_utils._BASE_TS_CONTEXT,
                  tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
    for resource in ('gcs_request_retries', 's3_request_retries'):
      context.setdefault(resource, dict(STORE_RETRIES))


_bound_store_retries()


class IncompatibleResume(ValueError):
  """The workdir's checkpoint was written by a config whose model or data differ."""


def flatten(tree, prefix=''):
  """{'model': {'d_model': 64}} -> {'model.d_model': 64} (nested dicts of a config.json)."""
  out = {}
  for key, value in tree.items():
    name = f'{prefix}{key}'
    if isinstance(value, dict):
      out.update(flatten(value, name + '.'))
    else:
      out[name] = value
  return out


# Fields that may change between a run and its resumption (noted, not refused).
SAFE_TO_CHANGE = ('train.steps', 'train.checkpoint_every', 'train.eval_every', 'train.log_every',
                  'train.keep_checkpoints', 'train.eval_batches', 'train.diagnostics',
                  'train.diagnostics_batch', 'train.skip_nonfinite', 'train.learning_rate',
                  'train.warmup_steps', 'train.schedule', 'train.grad_clip_norm',
                  'train.weight_decay', 'model.attention_impl', 'model.dropout', 'data.data_dir',
                  # Layout and precision: Orbax restores into the new shardings; the update is
                  # the same (accumulation), or only rounded differently (compute dtype, remat).
                  'mesh.data', 'mesh.fsdp', 'mesh.tensor', 'mesh.sequence', 'mesh.expert',
                  'mesh.rules',
                  'train.grad_accum_steps', 'train.compute_dtype', 'model.remat',
                  'train.loss_chunk', 'train.profile_steps')


def check_resume_config(workdir, config):
  """Compares `config` with the config.json of an existing run in `workdir` that has a checkpoint.

  A workdir without checkpoints constrains nothing: its config.json may be that of a run that
  failed before saving (out of memory, a mesh error), and the corrected command must run.

  Returns the list of safe fields that changed (to note); raises IncompatibleResume naming the
  fields that cannot change under a checkpoint (model shape, data stream, seed, batch size).
  """
  path = paths.join(workdir, 'config.json')
  if not paths.exists(path) or not any(
      name.isdigit() for name in paths.listdir(paths.join(workdir, 'checkpoints'))):
    return []
  try:
    old = flatten(paths.read_json(path))
  except ValueError as e:  # json.JSONDecodeError: damaged. The checkpoint's shapes still guard
    # the resume (restore_newest_good); the file is kept aside and written anew after the restore.
    aside = f'{path}.corrupt-{int(time.time())}'
    if jax.process_index() != 0:  # process 0 moves it
      return []
    paths.rename(path, aside)
    print(f'train: {path} is damaged ({e}); moved to {paths.basename(aside)}, checking the '
          'resume against the checkpoint\'s shapes only', file=sys.stderr)
    return []
  new = flatten(json.loads(config.to_json_best_effort()))
  # A field added to attnlab after the run started is unchanged if it holds its default.
  defaults = flatten(json.loads(default_config.get_config().to_json_best_effort()))
  changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k)
                   and not (k not in old and new.get(k) == defaults.get(k)))
  bad = [k for k in changed if k not in SAFE_TO_CHANGE]
  clip = 'train.grad_clip_norm'
  if clip in changed and (old.get(clip, 0) > 0) != (new.get(clip, 0) > 0):
    bad.append(clip)  # clipping on <-> off changes the optimiser state's structure
  if bad:
    raise IncompatibleResume(
        f'cannot resume {workdir}: its checkpoint was trained with different ' + ', '.join(
            f'{k} ({old.get(k)!r} -> {new.get(k)!r})' for k in bad) +
        '; use a new --workdir or the original values')
  return [f'{k} ({old.get(k)!r} -> {new.get(k)!r})' for k in changed]


def checkpoint_manager(workdir, config):
  """The Orbax manager of WORKDIR/checkpoints (local or gs://: Orbax writes it through
  tensorstore)."""
  return ocp.CheckpointManager(
      paths.absolute(paths.join(workdir, 'checkpoints')),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.train.keep_checkpoints, create=True))


def restore_state(mngr, state, step=None):
  """Restores (state, data iterator state) of `step` (default newest) into the structure of
  `state`."""
  step = mngr.latest_step() if step is None else step

  def restore(target):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    return mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))

  try:
    restored = restore(state)
  except Exception:
    if jax.tree.leaves(state.get('buffers', {})):
      raise
    # Checkpoints written before model buffers existed hold no 'buffers' entry; a model without
    # buffers restores from them as it did (a damaged checkpoint fails here again and is raised).
    restored = restore({k: v for k, v in state.items() if k != 'buffers'})
    return {**restored['state'], 'buffers': state['buffers']}, restored['data']
  return restored['state'], restored['data']


def restore_window(mngr, step):
  """The log window's sums saved with `step` ({'loss_sum', ..., 'steps'}), or None for a checkpoint
  written without them (before they were saved): the resumed run's first row is then partial."""
  if not paths.isdir(paths.join(mngr.directory, str(step), 'window')):
    return None
  return mngr.restore(step, args=ocp.args.Composite(window=ocp.args.JsonRestore()))['window']


class RunFailed(RuntimeError):
  """The run cannot go on; the message is one line (train.py prints it and exits 1)."""


class UnreadableCheckpoints(RunFailed):
  """Every checkpoint of a workdir is damaged: there is nothing to resume from."""


class SaveFailed(RunFailed):
  """A checkpoint could not be written (e.g. the disk is full)."""


def _plain_path(path):
  """A jax key path -> 'a/b/0/c', without a trailing `value` (nnx.Variable leaves)."""
  keys = [str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path]
  return '/'.join(keys[:-1] if keys and keys[-1] == 'value' else keys)


def saved_shapes(mngr, step):
  """{'params/decoder/...': shape} of the arrays the checkpoint `step` holds (its metadata only)."""
  metadata = ocp.StandardCheckpointer().metadata(paths.join(mngr.directory, str(step), 'state'))
  tree = getattr(metadata, 'item_metadata', metadata)
  return {_plain_path(p): tuple(leaf.shape)
          for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(leaf, 'shape')}


def shape_mismatch(saved, state):
  """Lines naming the arrays whose shapes differ between a checkpoint and `state` (empty: none).

  The model buffers may be absent from a checkpoint written before they existed (restore_state).
  """
  want = {_plain_path(p): tuple(np.shape(leaf))
          for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
  lines = [f'{k}: checkpoint {saved[k]}, this config {want[k]}'
           for k in sorted(set(saved) & set(want)) if saved[k] != want[k]]
  lines += [f'{k}: not in the checkpoint' for k in sorted(set(want) - set(saved))
            if not k.startswith('buffers/')]
  lines += [f'{k}: only in the checkpoint' for k in sorted(set(saved) - set(want))]
  return lines


@contextlib.contextmanager
def _quiet():
  """Orbax, tensorstore and asyncio report a failed restore at length; the caller says it once."""
  loggers = [logging.getLogger(n) for n in ('absl', 'asyncio', 'orbax')]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


def is_whole(saved, parts=('step', 'params', 'opt_state')):
  """Whether `saved_shapes` holds every part of a state: damaged metadata can read as a partial
  tree, and only a whole one can show that a checkpoint belongs to another model."""
  return all(any(k == part or k.startswith(part + '/') for k in saved) for part in parts)


def error_reason(e):
  """One short line for an Orbax/tensorstore error: the OS error where it names one."""
  text = str(e).strip()
  code = re.search(r"os_error_code='?(\d+)", text)
  if code:
    return f'{os.strerror(int(code.group(1)))} (errno {code.group(1)})'
  return text.splitlines()[0][:200] if text else type(e).__name__


class _DropOrbaxErrors(logging.Filter):
  """Orbax logs a failed asynchronous save's traceback from its thread; `confirm_saved` reports
  the failure in one line instead."""

  def filter(self, record):
    if record.levelno < logging.ERROR:
      return True
    if 'orbax' in (record.pathname or ''):
      return False
    # The failed write's future, which asyncio reports when it is collected unretrieved.
    return not (record.name == 'asyncio' and 'never retrieved' in str(record.msg))


def background_log(workdir):
  """The local file that takes the traces of a failed save's background threads:
  WORKDIR/logs/save-threads.log (a gs:// workdir: under the system's temporary directory)."""
  base = (os.path.join(tempfile.gettempdir(), f'attnlab-{os.getpid()}')
          if paths.is_remote(workdir) else workdir)
  return os.path.join(base, 'logs', 'save-threads.log')


class _BackgroundTraces:
  """A `sys.unraisablehook` that appends the closed-event-loop traces to a log file: after a
  failed save, tensorstore's pending futures each report a `RuntimeError: Event loop is closed` as
  they find Orbax's event loop gone (71 of them on a nearly full disk, interleaved); the run reports
  the failure in one line that names this file. Other unraisable exceptions go to the previous
  hook."""

  def __init__(self, path):
    self.path, self.previous = path, sys.unraisablehook

  def __call__(self, unraisable):
    value = unraisable.exc_value
    if not (isinstance(value, RuntimeError) and 'Event loop is closed' in str(value)):
      self.previous(unraisable)
      return
    try:  # the disk may be the full one: then the trace is dropped, never shown
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      with open(self.path, 'a') as f:
        f.write(''.join(traceback.format_exception(
            unraisable.exc_type, value, unraisable.exc_traceback)))
    except OSError:
      pass


@contextlib.contextmanager
def quiet_background_errors(workdir):
  """While active, Orbax's own error records are dropped (see `confirm_saved`) and other threads'
  traces go to `background_log(workdir)`. After a failure both stay: the failed write's futures are
  collected later, up to interpreter exit."""
  drop = _DropOrbaxErrors()
  loggers = [logging.getLogger('absl'), logging.getLogger('asyncio')]
  for logger in loggers:
    logger.addFilter(drop)
  hook = sys.unraisablehook = _BackgroundTraces(background_log(workdir))
  yield
  for logger in loggers:  # reached only when the run ended without an exception
    logger.removeFilter(drop)
  sys.unraisablehook = hook.previous


def restore_newest_good(mngr, state, workdir, move_aside=True):
  """Restores the newest readable checkpoint that fits `state`.

  Orbax commits a checkpoint atomically (a temporary directory renamed when complete), so a crash
  mid-save leaves no half-written step; this guards against damage after the commit. Only an
  unreadable checkpoint (files truncated or missing) is reported and, with `move_aside`, moved to
  `corrupt-<step>-<time>`; one that is readable but holds arrays of other shapes than `state` (a
  different model) is an IncompatibleResume naming them, whether or not config.json says so.

  Every item of a step (state, data position, log window) is read here: a step with any of them
  damaged falls back to the previous one.

  Returns:
    (state, data state, step, log window or None), or None when the workdir has no checkpoint.

  Raises:
    IncompatibleResume: the newest readable checkpoint does not fit `state`.
    UnreadableCheckpoints: every checkpoint is unreadable.
  """
  steps, unreadable = sorted(mngr.all_steps(), reverse=True), []
  for step in steps:
    try:
      with _quiet():
        saved = saved_shapes(mngr, step)
    except Exception as e:  # noqa: BLE001
      unreadable.append((step, error_reason(e)))
    else:
      mismatch = shape_mismatch(saved, state) if is_whole(saved) else []
      if mismatch:
        shown = f'{"; ".join(mismatch[:3])}' + (
            f'; and {len(mismatch) - 3} more' if len(mismatch) > 3 else '')
        raise IncompatibleResume(
            f'cannot resume {workdir}: its checkpoint step {step} holds arrays of other shapes '
            f'than this config ({shown}); use a new --workdir or the config it was trained with'
            if move_aside else  # evaluation: the config is the run's own config.json
            f'cannot evaluate {workdir}: its checkpoint step {step} holds arrays of other shapes '
            f'than its config.json says ({shown}); was config.json replaced?')
      try:
        with _quiet():
          restored, data_state = restore_state(mngr, state, step)
          window = restore_window(mngr, step)
      except Exception as e:  # noqa: BLE001
        unreadable.append((step, error_reason(e)))
      else:
        # Only now, with a good one to go back to, are the newer unreadable ones moved aside.
        for bad, _ in unreadable if move_aside else ():
          paths.rename(paths.join(mngr.directory, str(bad)), paths.join(
              mngr.directory, f'corrupt-{bad}-{int(time.time())}'))
        if unreadable and move_aside:
          mngr.reload()
        return restored, data_state, step, window
    bad, reason = unreadable[-1]
    print(f'checkpoint step {bad} in {workdir} is unreadable ({reason})' +
          (f'; {"moving it to corrupt-" + str(bad) + "-TIME and " if move_aside else ""}trying '
           'the previous one' if bad != steps[-1] else ''), file=sys.stderr)
  if unreadable:
    raise UnreadableCheckpoints(
        f'every checkpoint in {paths.join(workdir, "checkpoints")} is unreadable (steps '
        f'{", ".join(str(s) for s, _ in unreadable)}); nothing to resume from: remove them to '
        'start over, or use a new --workdir')
  return None


def confirm_saved(mngr, workdir):
  """Waits for the asynchronous save in flight, if any; raises SaveFailed (one line: what failed,
  the free space, the last good step) if it or an earlier one failed."""
  try:
    with _quiet():
      mngr.wait_until_finished()
      mngr.check_for_errors()
  except Exception as e:  # noqa: BLE001
    raise save_failed(mngr, workdir, e) from None


def save_failed(mngr, workdir, error):
  """The SaveFailed of `error`, naming the free space and the newest complete checkpoint."""
  directory = paths.join(workdir, 'checkpoints')
  try:
    if paths.is_remote(directory):
      raise OSError('object storage has no free-space figure')
    usage = shutil.disk_usage(directory)
    free = f'{usage.free / 2 ** 30:.2f} GiB free'
  except OSError:
    free = 'free space unknown'
  mngr.reload()
  good = mngr.latest_step()
  return SaveFailed(f'train: saving a checkpoint in {directory} failed ({error_reason(error)}; '
                    f'{free}); ' + (f'the last good checkpoint is step {good}' if good is not None
                                    else 'no checkpoint was saved') +
                    f'; stopping (its threads\' traces, if any: {background_log(workdir)})')
