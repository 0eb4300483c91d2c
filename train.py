"""Trains an attnlab model: `python train.py --config=configs/NAME.py --workdir=DIR`.

Resumes from the newest checkpoint in DIR (parameters, optimiser and data position), so a killed run
rerun with the same command continues with exactly the batches it would have seen.
"""

import functools
import json
import math
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
import tqdm

from configs import validation
from data import pipeline
import models

FLAGS = flags.FLAGS


def define_flags():
  """The CLI flags, defined only when run as a program (eval.py imports this module)."""
  config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and logs.')


class NonFiniteLoss(RuntimeError):
  """The loss became NaN or inf."""


def make_schedule(t):
  """Linear warmup to `learning_rate` over `warmup_steps`, then `schedule` (optax)."""
  decay_steps = t.steps - t.warmup_steps
  after = {
      'cosine': optax.cosine_decay_schedule(t.learning_rate, decay_steps),
      'linear': optax.linear_schedule(t.learning_rate, 0.0, decay_steps),
      'constant': optax.constant_schedule(t.learning_rate),
  }[t.schedule]
  if t.warmup_steps == 0:
    return after
  warmup = optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps)
  return optax.join_schedules([warmup, after], [t.warmup_steps])


def make_optimizer(t):
  """AdamW with the schedule, after optional global-norm clipping."""
  chain = [optax.clip_by_global_norm(t.grad_clip_norm)] if t.grad_clip_norm > 0 else []
  chain.append(optax.adamw(make_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))
  return optax.chain(*chain)


def create_state(config, vocab_size):
  """Builds the model and optimiser; returns (graphdef, optimizer, state pytree)."""
  model = models.build(config.model, vocab_size, config.data.max_length,
                       rngs=nnx.Rngs(params=config.train.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  tx = make_optimizer(config.train)
  state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': tx.init(params)}
  return graphdef, tx, state


def compute_metrics(logits, targets, weights):
  """Weighted sums (reduced across batches, then divided): loss, correct tokens, token count."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)  # [B, T]
  return {'loss_sum': jnp.sum(ce * weights), 'correct_sum': jnp.sum(correct * weights),
          'weight_sum': jnp.sum(weights)}


def finalize(sums):
  """Turns summed metrics into means."""
  denom = max(float(sums['weight_sum']), 1.0)
  out = {'loss': float(sums['loss_sum']) / denom, 'accuracy': float(sums['correct_sum']) / denom}
  out.update({k: float(v) for k, v in sums.items() if not k.endswith('_sum')})
  return out


def train_step(graphdef, tx, base_rng, state, batch):
  """One optimisation step, a pure function of the state (jit it with the state donated)."""
  # Fold the step into the key: a resumed run draws the same dropout/masks as an uninterrupted one.
  dropout_rng, mask_rng = jax.random.split(jax.random.fold_in(base_rng, state['step']))

  def loss_fn(params):
    model = nnx.merge(graphdef, params)
    logits, targets, weights = model.loss_terms(batch, rngs=nnx.Rngs(dropout=dropout_rng, mask=mask_rng))
    sums = compute_metrics(logits, targets, weights)
    return sums['loss_sum'] / jnp.maximum(sums['weight_sum'], 1.0), sums

  (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  sums['grad_norm'] = optax.global_norm(grads)
  sums['param_norm'] = optax.global_norm(params)
  return {'step': state['step'] + 1, 'params': params, 'opt_state': opt_state}, sums


def eval_step(graphdef, params, batch):
  """Summed metrics of one batch without dropout."""
  model = nnx.merge(graphdef, params)
  return compute_metrics(*model.loss_terms(batch))


def evaluate(eval_fn, params, config, split, num_batches, length=None):
  """Mean loss/accuracy over the first `num_batches` batches (0 = all) of `split`, in order."""
  it = pipeline.make_iterator(config.data, split, config.train.batch_size, arch=config.model.arch,
                              loss_on=config.train.loss_on, shuffle=False, repeat=False,
                              drop_remainder=False, length=length)
  total = None
  for i, batch in enumerate(it):
    if num_batches and i >= num_batches:
      break
    sums = eval_fn(params, batch)
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  return finalize(total)


def checkpoint_manager(workdir, config):
  return ocp.CheckpointManager(
      os.path.abspath(os.path.join(workdir, 'checkpoints')),
      options=ocp.CheckpointManagerOptions(max_to_keep=config.train.keep_checkpoints, create=True))


def restore_state(mngr, state, step=None):
  """Restores (state, data iterator state) of `step` (default newest) into the structure of `state`."""
  step = mngr.latest_step() if step is None else step
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = mngr.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
  return restored['state'], restored['data']


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


def train_and_evaluate(config, workdir, _interrupt_after=None):
  """Trains `config` in `workdir`, resuming if a checkpoint exists. Returns the last train metrics.

  `_interrupt_after` (tests only) raises KeyboardInterrupt after that step, as a kill would.
  """
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  t = config.train
  tokenizer = pipeline.get_tokenizer(config.data)
  graphdef, tx, state = create_state(config, tokenizer.vocab_size)
  it = pipeline.make_iterator(config.data, 'train', t.batch_size, arch=config.model.arch,
                              loss_on=t.loss_on, seed=t.seed)
  mngr = checkpoint_manager(workdir, config)
  start = 0
  if mngr.latest_step() is not None:
    state, data_state = restore_state(mngr, state)
    it.set_state(data_state)
    start = int(state['step'])
    print(f'train: resumed from step {start} in {workdir}', file=sys.stderr)
  writer = MetricsWriter(workdir, start)

  base_rng = jax.random.key(t.seed)
  step_fn = jax.jit(functools.partial(train_step, graphdef, tx, base_rng), donate_argnums=(0,))
  eval_fn = jax.jit(functools.partial(eval_step, graphdef))
  schedule = make_schedule(t)
  window, window_steps, window_tokens, window_start = None, 0, 0, time.perf_counter()
  last = {}
  bar = tqdm.tqdm(total=t.steps, initial=start, desc='train', mininterval=1.0, file=sys.stderr,
                  dynamic_ncols=True)
  try:
    for step in range(start + 1, t.steps + 1):
      batch = next(it)
      state, sums = step_fn(state, batch)
      # Read the loss every step: a non-finite value must stop the run before it is checkpointed.
      loss = float(sums['loss_sum']) / max(float(sums['weight_sum']), 1.0)
      if not math.isfinite(loss):
        raise NonFiniteLoss(f'train: non-finite loss ({loss}) at step {step}; stopping. The last '
                            f'good checkpoint is step {mngr.latest_step()} in {workdir}')
      window = sums if window is None else jax.tree.map(jnp.add, window, sums)
      window_steps += 1
      window_tokens += int(np.sum(batch['weights'] > 0) if 'segment_ids' not in batch
                           else np.sum(batch['segment_ids'] > 0))
      bar.update(1)
      if step % t.log_every == 0 or step == t.steps:
        elapsed = time.perf_counter() - window_start
        last = finalize(window)
        last['grad_norm'] = float(window['grad_norm']) / window_steps
        last['param_norm'] = float(sums['param_norm'])
        last['learning_rate'] = float(schedule(step - 1))
        last['tokens_per_sec'] = window_tokens / elapsed
        writer.write(step, 'train', last)
        bar.set_postfix(loss=f'{last["loss"]:.3f}', tok_s=f'{last["tokens_per_sec"]:.0f}')
        window, window_steps, window_tokens, window_start = None, 0, 0, time.perf_counter()
      if step % t.eval_every == 0 or step == t.steps:
        writer.write(step, 'valid', evaluate(eval_fn, state['params'], config, 'validation',
                                             t.eval_batches))
      if step % t.checkpoint_every == 0 or step == t.steps:
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                data=ocp.args.JsonSave(it.get_state())))
      if _interrupt_after == step:
        raise KeyboardInterrupt(f'test interruption after step {step}')
  finally:
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
  return last


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
  if FLAGS.workdir is None:
    print('train: --workdir is required', file=sys.stderr)
    sys.exit(2)
  config = validation.resolve(FLAGS.config.unlock())
  try:
    validation.validate(config)
  except validation.ConfigError as e:
    print(f'config error: {e}', file=sys.stderr)
    sys.exit(2)
  try:
    train_and_evaluate(config, FLAGS.workdir)
  except NonFiniteLoss as e:
    print(str(e), file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  flags.mark_flags_as_required(['config'])
  app.run(main)
