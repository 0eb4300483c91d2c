"""Shared by the training-loop tests: a quick config on a given data dir, and metrics readers."""

import json
import os
import signal

from configs import decoder_only
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
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if r['split'] == split]
