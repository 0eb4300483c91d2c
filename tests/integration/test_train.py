"""The training loop: loss falls, resume reproduces the uninterrupted run, bad configs are
rejected."""

import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from data import pipeline
import models
from tests.helpers import ROOT, interrupt_after, metric_rows, quick_config
from layers import sharding
from training import evaluation
from training import loop
from training import state as state_lib



def read_metrics(workdir, split='train'):
  return {r['step']: r['loss'] for r in metric_rows(workdir, split)}


def test_a_few_steps_lower_the_loss(data_dir, tmp_path):
  config = quick_config(data_dir, steps=30, log_every=5, learning_rate=3e-3)
  loop.train_and_evaluate(config, str(tmp_path))
  losses = read_metrics(tmp_path)
  assert losses[30] < 0.8 * losses[5], losses
  assert set(os.listdir(tmp_path)) >= {'config.json', 'checkpoints', 'metrics.jsonl'}
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(tmp_path))


def test_resume_reproduces_the_uninterrupted_run(data_dir, tmp_path):
  config = quick_config(data_dir, steps=16, log_every=1, checkpoint_every=5, eval_every=100)
  full = tmp_path / 'full'
  loop.train_and_evaluate(config, str(full))
  # Interrupted: stop after step 13 (checkpoint at 10), then rerun the same config.
  cut = tmp_path / 'cut'
  with pytest.raises(KeyboardInterrupt):
    loop.train_and_evaluate(config, str(cut), hooks=[interrupt_after(13)])
  assert read_metrics(cut)[13]
  loop.train_and_evaluate(config, str(cut))
  a, b = read_metrics(full), read_metrics(cut)
  assert sorted(a) == sorted(b) == list(range(1, 17))
  for step in a:
    assert a[step] == pytest.approx(b[step], abs=1e-6), step
  (_, _, x, step_x), (_, _, y, step_y) = (evaluation.load_run(str(w)) for w in (full, cut))
  assert step_x == step_y == 16
  for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
    np.testing.assert_array_equal(p, q)


# The SIGKILL test of CI is tests/integration/test_faults.py's, at ten moments of one run.
@pytest.mark.slow
def test_sigkill_then_rerun_resumes(data_dir, tmp_path):
  """A real SIGKILL after the first checkpoint: the rerun continues to the uninterrupted run's rows
  and parameters."""
  base = [sys.executable, os.path.join(ROOT, 'train.py'), '--config=' + os.path.join(
      ROOT, 'configs/decoder_only.py:quick'), f'--config.data.data_dir={data_dir}',
          '--config.train.steps=40', '--config.train.checkpoint_every=5',
          '--config.train.log_every=1', '--config.train.eval_every=100']
  killed = tmp_path / 'killed'
  proc = subprocess.Popen(base + [f'--workdir={killed}'], cwd=ROOT, stderr=subprocess.DEVNULL)
  ckpt = killed / 'checkpoints'
  deadline = time.time() + 120
  while time.time() < deadline and proc.poll() is None:
    steps = [int(p) for p in os.listdir(ckpt) if p.isdigit()] if ckpt.exists() else []
    if steps and max(steps) >= 10:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, 'run finished before it could be killed'
  subprocess.run(base + [f'--workdir={killed}'], cwd=ROOT, check=True, stderr=subprocess.DEVNULL)
  config = quick_config(data_dir, steps=40, checkpoint_every=5, log_every=1, eval_every=100)
  loop.train_and_evaluate(config, str(tmp_path / 'clean'))
  keys = ('step', 'loss', 'accuracy', 'grad_norm', 'param_norm', 'learning_rate')
  rows = lambda w: [tuple(r.get(k) for k in keys) for r in metric_rows(w)]  # noqa: E731
  assert [r[0] for r in rows(killed)] == list(range(1, 41))
  assert rows(killed) == rows(tmp_path / 'clean')
  (_, _, a, step_a), (_, _, b, step_b) = (evaluation.load_run(str(w))
                                          for w in (killed, tmp_path / 'clean'))
  assert step_a == step_b == 40
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)


def test_cli_rejects_bad_heads_with_one_line(tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'train.py'),
       '--config=' + os.path.join(ROOT, 'configs/decoder_only.py'),
       '--config.model.num_heads=7', f'--workdir={tmp_path / "w"}'],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 2
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and 'model.num_heads=7' in lines[0], out.stderr
  assert not (tmp_path / 'w').exists()


def test_blockwise_training_curve_equals_xla(data_dir, tmp_path):
  """The flash kernel changes nothing in training: same losses step by step (float32)."""
  curves = {}
  for impl in ('xla', 'blockwise'):
    config = quick_config(data_dir, steps=8, log_every=1, eval_every=100)
    config.model.attention_impl = impl
    loop.train_and_evaluate(config, str(tmp_path / impl))
    curves[impl] = read_metrics(tmp_path / impl)
  for step, loss in curves['xla'].items():
    assert curves['blockwise'][step] == pytest.approx(loss, abs=1e-5), step


def _config_steps(config, steps):
  """(losses, final state, the traced step) of `steps` steps of train.py's own jitted step
  (loop.jit_train_step, which takes the step's options from `config.train`), without the loop's
  I/O."""
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  graphdef, tx, state = state_lib.create_state(
      config, pipeline.get_tokenizer(config.data).vocab_size, mesh)
  it = pipeline.make_iterator(config.data, 'train', config.train.batch_size,
                              batch_format=models.batch_format(config.model.arch),
                              loss_on=config.train.loss_on)
  losses = []
  with jax.set_mesh(mesh), sharding.use_rules(mesh, sharding.rules_of(config.mesh)):
    step = loop.jit_train_step(config, graphdef, tx, state, mesh, None)
    for i, batch in zip(range(steps), it):
      if i == 0:
        traced = step.trace(state, batch)
      state, sums = step(state, batch)
      losses.append(float(sums['loss_sum'] / sums['weight_sum']))
  return losses, state, traced


def test_gradient_accumulation_set_in_the_config_equals_the_whole_batch(data_dir):
  """train.grad_accum_steps=4: the step scans 4 micro-batches of 2 rows, and its losses and
  parameters are the whole batch's."""
  whole, whole_state, whole_step = _config_steps(quick_config(data_dir), 6)
  accumulated, state, step = _config_steps(quick_config(data_dir, grad_accum_steps=4), 6)
  scans = lambda traced: set(re.findall(r'length=(\d+)', str(traced.jaxpr)))  # noqa: E731
  assert '4' in scans(step) and '4' not in scans(whole_step)
  assert accumulated == pytest.approx(whole, rel=1e-5)
  for a, b in zip(jax.tree.leaves(state['params']), jax.tree.leaves(whole_state['params'])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bfloat16_set_in_the_config_computes_in_bfloat16_keeps_float32_parameters_and_trains(
    data_dir):
  f32, _, f32_step = _config_steps(quick_config(data_dir, learning_rate=3e-3), 12)
  bf16, state, step = _config_steps(
      quick_config(data_dir, learning_rate=3e-3, compute_dtype='bfloat16'), 12)
  dots = lambda traced: re.findall(r'stablehlo.dot_general.*', traced.lower().as_text())  # noqa
  assert dots(f32_step) and not any('bf16' in d for d in dots(f32_step))
  assert sum('bf16' in d for d in dots(step)) >= len(dots(step)) // 2, dots(step)
  assert {x.dtype.name for x in jax.tree.leaves(state['params'])} == {'float32'}
  assert bf16[-1] < 0.8 * bf16[0]
  assert bf16 != f32 and bf16 == pytest.approx(f32, rel=0.05)  # bfloat16 rounding, same course
