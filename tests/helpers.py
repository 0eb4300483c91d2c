"""Shared by the tests: quick configs, training hooks, metrics readers and synthetic workdirs."""

import json
import os
import signal

from training import writers
from configs import decoder_only
from configs import default
from training import validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quick_config(data_dir, **train_overrides):
  """The validated `decoder_only.py:quick` config reading data from `data_dir`."""
  config = validation.resolve(decoder_only.get_config('quick'))
  config.data.data_dir = str(data_dir)
  config.train.update(train_overrides)
  validation.validate(config)
  return config


def interrupt_after(step):
  """A training hook that raises KeyboardInterrupt after `step`, as a kill would (no save)."""
  def hook(s, state):
    del state
    if s == step:
      raise KeyboardInterrupt(f'test interruption after step {step}')
  return hook


def sigterm_after(step):
  """A training hook that sends this process SIGTERM after `step` (a preemption notice)."""
  def hook(s, state):
    del state
    if s == step:
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


def metric_rows(workdir, split='train'):
  """The metrics.jsonl rows of `split`, in order."""
  rows = writers.read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  return [r for r in rows if r['split'] == split]


def tiny(length=64, **model):
  """The validated `default.py:size=tiny` config (L 2, D 64, N 4, F 256) at `length`."""
  config = default.get_config('size=tiny')
  config.data.max_length = length
  config.model.update(model)
  validation.resolve(config)
  validation.validate(config)
  return config


def tiny_config(**model):
  config = validation.resolve(decoder_only.get_config('quick'))
  config.model.update(num_layers=3, d_model=32, num_heads=4, d_ff=64, **model)
  config.train.diagnostics = True
  return validation.resolve(config)


def write_run(workdir, train, valid=(), *, steps=100, seed=0, fields=None, entropy=None,
              num_params=1000):
  """A synthetic workdir: train/valid [(step, loss)], config.json, run_info.json."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for step, loss in train:
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': loss,
                          'tokens_per_sec': 1000.0 + step}) + '\n')
    for step, loss in valid:
      f.write(json.dumps({'step': step, 'split': 'valid', 'loss': loss}) + '\n')
  config = {'train': {'steps': steps, 'seed': seed}, 'model': dict(fields or {})}
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(config, f)
  info = {'num_params': num_params}
  if entropy is not None:
    info['unigram_entropy'] = entropy
  with open(os.path.join(workdir, 'run_info.json'), 'w') as f:
    json.dump(info, f)
