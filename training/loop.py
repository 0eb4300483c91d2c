"""The training loop: `train_and_evaluate(config, workdir, hooks=...)`, resuming where a run stopped."""

import functools
import json
import math
import os
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import orbax.checkpoint as ocp
import tqdm

from data import pipeline
from layers import sharding
import models
from training import checkpointing
from training import distributed
from training import diagnostics
from training import evaluation
from training import state as state_lib
from training import steps
from training import writers


class NonFiniteLoss(RuntimeError):
  """The loss or the gradient became NaN or inf."""


class Stopped(Exception):
  """SIGTERM/SIGINT: the run saved a checkpoint at the current step and stopped."""

  def __init__(self, signum, step):
    super().__init__(f'train: stopped by {signal.Signals(signum).name} after step {step}; '
                     'checkpoint saved, rerun the same command to resume')
    self.signum = signum




def train_and_evaluate(config, workdir, hooks=()):
  """Trains `config` in `workdir`, resuming if a checkpoint exists. Returns the last train metrics.

  Args:
    config: a validated config (`training.validation.resolve` + `validate`).
    workdir: the run's directory (config.json, checkpoints/, metrics.jsonl, TensorBoard events).
    hooks: callables `hook(step, state)` run after every step, after its logging and evaluation
      and before the step's checkpoint and stop decision; e.g. a profiler trigger, or a test that
      sends SIGTERM or raises at a chosen step. `state` is the training state pytree.
  """
  os.makedirs(workdir, exist_ok=True)
  lead = jax.process_index() == 0  # multi-process: only process 0 writes logs and reports
  for change in checkpointing.check_resume_config(workdir, config):
    if lead:
      print(f'train: resuming with changed {change}', file=sys.stderr)
  if lead:
    path = os.path.join(workdir, 'config.json')
    with open(path + '.tmp', 'w') as f:  # other processes may be reading it (resume check)
      f.write(config.to_json_best_effort(indent=2))
    os.replace(path + '.tmp', path)
  t = config.train
  tokenizer = pipeline.get_tokenizer(config.data)
  mesh = distributed.make_mesh(config)
  rules = sharding.rules_of(config.get('mesh', {}))
  graphdef, tx, state = state_lib.create_state(
      config, tokenizer.vocab_size, mesh, special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  # Rows first_row, ... of every global batch: all of it, or with data.shards and several
  # processes the shards of the rows this process's devices hold.
  it = pipeline.ShardedIterator(config.data, 'train', t.batch_size, config.data.get('shards', 1),
                                distributed.data_shards(config, mesh, rules),
                                arch=models.batch_format(config.model.arch), loss_on=t.loss_on,
                                seed=t.seed)
  mngr = checkpointing.checkpoint_manager(workdir, config)
  start = 0
  restored = checkpointing.restore_newest_good(mngr, state, workdir) if mngr.all_steps() else None
  if restored is not None:
    state, data_state, _ = restored
    it.set_state(data_state)
    start = int(state['step'])
    print(f'train: resumed from step {start} in {workdir}', file=sys.stderr)
  writer = writers.MetricsWriter(workdir, start) if lead else writers.NullWriter()

  # The parameter count per group goes to run_info.json (metrics.jsonl rows all carry a loss).
  groups, leaf_groups, group_sizes = diagnostics.param_groups(state['params'])
  info_path = os.path.join(workdir, 'run_info.json')
  info = {}
  if os.path.exists(info_path):
    with open(info_path) as f:
      info = json.load(f)
  info.update(num_params=sum(group_sizes.values()), params_by_group=group_sizes)
  if lead:
    writers.write_json(info_path, info)

  base_rng = jax.random.key(t.seed)

  def in_mesh(fn):  # traced (on the first call) under the mesh (ring attention reads it) and
    def call(*args):  # with the activation sharding rules active
      with jax.set_mesh(mesh), sharding.use_rules(mesh, rules):
        return fn(*args)
    return call

  # The state keeps its layout step after step; the metrics come back replicated.
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step_fn = in_mesh(jax.jit(functools.partial(steps.train_step, graphdef, tx, base_rng,
                                              leaf_groups=leaf_groups if t.diagnostics else None,
                                              skip_nonfinite=t.skip_nonfinite,
                                              accum_steps=t.get('grad_accum_steps', 1),
                                              compute_dtype=t.get('compute_dtype', 'float32')),
                            donate_argnums=(0,),
                            out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated)))
  diag_fn, eval_fn = (
      (lambda jitted: lambda variables, batch: jitted(variables, distributed.place_batch(batch, mesh, rules)))(
          in_mesh(jax.jit(functools.partial(fn, graphdef))))
      for fn in (diagnostics.diagnostic_pass, steps.eval_step))
  schedule = state_lib.make_schedule(t)
  # Layers that redraw random features every R steps (the Performer; see redraw_features).
  model = nnx.merge(graphdef, *state_lib.model_variables(state))
  redraw_periods = {m.redraw_every for _, m in nnx.iter_modules(model)
                    if getattr(m, 'redraw_every', 0) > 0}
  del model
  window, window_steps, window_tokens, window_start = None, 0, 0, time.perf_counter()
  last = {}
  bar = tqdm.tqdm(total=t.steps, initial=start, desc='train', mininterval=1.0, file=sys.stderr,
                  dynamic_ncols=True, disable=not lead)

  def save(step):
    # Process 0 writes the data position: every shard's, gathered from the processes reading them.
    data_state = pipeline.ShardedIterator.merge_states(distributed.allgather_json(it.get_state()))
    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=ocp.args.JsonSave(data_state)))

  # SIGTERM (preemption) and SIGINT finish the current step, save, and stop (see Stopped).
  received = []
  handlers = {}
  if threading.current_thread() is threading.main_thread():
    for signum in (signal.SIGTERM, signal.SIGINT):
      handlers[signum] = signal.signal(signum, lambda signum, _: received.append(signum))
  try:
    for step in range(start + 1, t.steps + 1):
      batch = next(it)
      # Features due at this step are drawn before it, so that a checkpoint or evaluation after
      # step s holds the draw step s trained with.
      if step > 1 and any((step - 1) % r == 0 for r in redraw_periods):
        state = state_lib.redraw_features(graphdef, state, step - 1)
      state, sums = step_fn(state, distributed.place_batch(batch, mesh, rules, it.first_row, t.batch_size))
      diag = sums.pop('diag', None)  # per-group [G] norms, read at log steps only
      # Read the loss every step: a non-finite value must stop the run before it is checkpointed.
      loss = float(sums['loss_sum']) / max(float(sums['weight_sum']), 1.0)
      grad_norm = float(sums['grad_norm'])
      if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        writer.write(step, 'train', {'loss': loss})  # so that sweep comparisons see the divergence
        name, value = ('loss', loss) if not math.isfinite(loss) else ('grad_norm', grad_norm)
        raise NonFiniteLoss(f'train: non-finite {name} ({value}) at step {step}; stopping. The '
                            f'last good checkpoint is step {mngr.latest_step()} in {workdir} '
                            '(train.skip_nonfinite=True skips such steps instead)')
      if step == 1 and diag is not None and lead:
        # Step 1's gradient is taken at the initial parameters (Xiong et al. 2020, Figure 3).
        grad = np.sqrt(np.asarray(jax.device_get(diag['grad_sq']), np.float64))
        writers.write_json(os.path.join(workdir, 'init_grad_norms.json'), {
            'grad_norm': float(np.sqrt(np.sum(np.square(grad)))),
            'groups': dict(zip(groups, map(float, grad))),
            'blocks': [float(v) for n, v in zip(groups, grad) if '/blocks/' in f'/{n}'],
            'norm_position': config.model.norm_position, 'num_layers': config.model.num_layers})
      if 'unigram_entropy' not in info:  # the level compare's plateau rule uses
        info['unigram_entropy'] = diagnostics.unigram_entropy(distributed.global_batch(batch, it.first_row, t.batch_size))
        if lead:
          writers.write_json(info_path, info)
      window = sums if window is None else jax.tree.map(jnp.add, window, sums)
      window_steps += 1
      # This process's rows, scaled to the global batch where it reads only some.
      window_tokens += steps.count_tokens(batch) * t.batch_size / len(next(iter(batch.values())))
      bar.update(1)
      if step % t.log_every == 0 or step == t.steps:
        elapsed = time.perf_counter() - window_start
        last = steps.finalize(window)
        last['grad_norm'] = float(window['grad_norm']) / window_steps
        last['param_norm'] = float(sums['param_norm'])
        last['learning_rate'] = float(schedule(step - 1))
        last['tokens_per_sec'] = window_tokens / elapsed
        if t.skip_nonfinite:
          last['skipped_steps'] = int(state['skipped'])
        if diag is not None:  # the log step's values (not window means)
          last.update(diagnostics.diagnostic_metrics(groups, diag))
          rows = t.diagnostics_batch or t.batch_size
          whole = distributed.global_batch(batch, it.first_row, t.batch_size)
          last.update({k: float(v) for k, v in diag_fn(
              state_lib.model_variables(state), jax.tree.map(lambda a: a[:rows], whole)).items()})
        writer.write(step, 'train', last)
        bar.set_postfix(loss=f'{last["loss"]:.3f}', tok_s=f'{last["tokens_per_sec"]:.0f}')
        window, window_steps, window_tokens, window_start = None, 0, 0, time.perf_counter()
      if step % t.eval_every == 0 or step == t.steps:
        writer.write(step, 'valid', evaluation.evaluate(eval_fn, state_lib.model_variables(state), config,
                                             'validation', t.eval_batches))
      for hook in hooks:
        hook(step, state)  # a signal a hook sends is handled before the next line
      stop = distributed.agreed_signal(received)
      if step % t.checkpoint_every == 0 or step == t.steps or stop:
        save(step)
      if stop:
        raise Stopped(stop, step)
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
  return last

