"""Orbax checkpoints of the training state and the data position, and the checks before a resume."""

import json
import os
import sys
import time

import jax
import orbax.checkpoint as ocp

from configs import default as default_config


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
                  'mesh.data', 'mesh.fsdp', 'mesh.tensor', 'mesh.sequence', 'mesh.rules',
                  'train.grad_accum_steps', 'train.compute_dtype', 'model.remat',
                  'train.loss_chunk', 'train.profile_steps')


def check_resume_config(workdir, config):
  """Compares `config` with the config.json of an existing run in `workdir`.

  Returns the list of safe fields that changed (to note); raises IncompatibleResume naming the
  fields that cannot change under a checkpoint (model shape, data stream, seed, batch size).
  """
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    old = flatten(json.load(f))
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
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, 'checkpoints')),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.train.keep_checkpoints, create=True))


def restore_state(mngr, state, step=None):
  """Restores (state, data iterator state) of `step` (default newest) into the structure of `state`."""
  step = mngr.latest_step() if step is None else step

  def restore(target):
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    return mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))

  try:
    restored = restore(state)
  except Exception:  # pylint: disable=broad-except
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
  if not os.path.isdir(os.path.join(mngr.directory, str(step), 'window')):
    return None
  return mngr.restore(step, args=ocp.args.Composite(window=ocp.args.JsonRestore()))['window']


def restore_newest_good(mngr, state, workdir):
  """Restores the newest readable checkpoint; unreadable ones are reported and moved aside.

  Orbax commits a checkpoint atomically (a temporary directory renamed when complete), so a crash
  mid-save leaves no half-written step; this guards against damage after the commit (files
  truncated or missing). Returns (state, data state, step) or None when no checkpoint is readable.
  """
  for step in sorted(mngr.all_steps(), reverse=True):
    try:
      restored, data_state = restore_state(mngr, state, step)
      return restored, data_state, step
    except Exception as e:  # pylint: disable=broad-except  # orbax/tensorstore raise many kinds
      path = os.path.join(mngr.directory, str(step))
      aside = os.path.join(mngr.directory, f'corrupt-{step}-{int(time.time())}')
      reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
      print(f'train: checkpoint step {step} in {workdir} is unreadable ({reason}); moved to '
            f'{aside}, trying the previous one', file=sys.stderr)
      os.rename(path, aside)
      mngr.reload()
  return None


