"""The training loop: loss falls, resume reproduces the uninterrupted run, bad configs are
rejected."""

import functools
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from data import pipeline
import models
from tests.helpers import ROOT, interrupt_after, metric_rows, quick_config
from training import loop
from training import state as state_lib
from training import steps as steps_lib



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


def test_sigkill_then_rerun_resumes(data_dir, tmp_path):
  """A real SIGKILL after the first checkpoint: the rerun continues and ends at the same loss."""
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
  a, b = read_metrics(killed), read_metrics(tmp_path / 'clean')
  assert sorted(a) == list(range(1, 41))
  assert a[40] == pytest.approx(b[40], abs=1e-6)


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


def _step_losses(config, steps, **step_kwargs):
  """Losses of `steps` train steps (train.py's state and step, without the loop's I/O)."""
  graphdef, tx, state = state_lib.create_state(config,
                                               pipeline.get_tokenizer(config.data).vocab_size)
  it = pipeline.make_iterator(config.data, 'train', config.train.batch_size,
                              batch_format=models.batch_format(config.model.arch),
                              loss_on=config.train.loss_on)
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0),
                                   **step_kwargs))
  losses = []
  for _, batch in zip(range(steps), it):
    state, sums = step(state, batch)
    losses.append(float(sums['loss_sum'] / sums['weight_sum']))
  return losses, state


def test_gradient_accumulation_equals_the_whole_batch(data_dir):
  config = quick_config(data_dir)
  whole, _ = _step_losses(config, 6)
  accumulated, _ = _step_losses(config, 6, accum_steps=4)  # 4 micro-batches of 2 rows
  assert accumulated == pytest.approx(whole, rel=1e-5)


def test_bfloat16_compute_keeps_float32_parameters_and_trains(data_dir):
  config = quick_config(data_dir, learning_rate=3e-3)
  f32, _ = _step_losses(config, 12)
  bf16, state = _step_losses(config, 12, compute_dtype='bfloat16')
  assert {x.dtype.name for x in jax.tree.leaves(state['params'])} == {'float32'}
  assert bf16[-1] < 0.8 * bf16[0]
  assert bf16 != f32 and bf16 == pytest.approx(f32, rel=0.05)  # bfloat16 rounding, same course
