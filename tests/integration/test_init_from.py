"""train.init_from: a run starts from another run's parameters (fresh optimiser, step 0), e.g. to
continue at a longer length with a RoPE scaling; bad sources are refused in one line."""

import json
import os

import jax
import numpy as np
import pytest

from tests.helpers import metric_rows, quick_config
from training import checkpointing
from training import loop
from training import state as state_lib


def _config(data_dir, **overrides):
  config = quick_config(data_dir, steps=6, log_every=2, eval_every=1000, checkpoint_every=1000,
                        warmup_steps=0, diagnostics=False)
  config.model.position = 'rope'
  for field, value in overrides.items():
    section, name = field.split('.')
    config[section][name] = value
  return config


def _newest_params(workdir, config):
  _, _, state = state_lib.create_state(config, _vocab(config))
  mngr = checkpointing.checkpoint_manager(workdir, config)
  restored, _ = checkpointing.restore_state(mngr, state)
  return restored['params']


def _vocab(config):
  from data import pipeline
  return pipeline.get_tokenizer(config.data).vocab_size


def test_a_longer_fine_tune_starts_from_the_source_parameters_at_step_0(data_dir, tmp_path,
                                                                        capsys):
  base = _config(data_dir)
  loop.train_and_evaluate(base, str(tmp_path / 'base'))
  # The fine-tune: twice the length, YaRN at factor 2, its own (shorter) schedule.
  tune = _config(data_dir, **{'train.init_from': str(tmp_path / 'base'), 'train.steps': 4,
                              'data.max_length': 2 * base.data.max_length})
  tune.model.rope_scaling, tune.model.rope_scaling_factor = 'yarn', 2.0

  # Its state at step 0: the source's newest parameters, a fresh optimiser.
  _, _, fresh = state_lib.create_state(tune, _vocab(tune))
  seeded, source_step = state_lib.init_from(fresh, str(tmp_path / 'base'))
  assert source_step == 6 and int(seeded['step']) == 0
  for got, want in zip(jax.tree.leaves(seeded['params']),
                       jax.tree.leaves(_newest_params(str(tmp_path / 'base'), base))):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(jax.tree.leaves(seeded['opt_state']), jax.tree.leaves(fresh['opt_state'])):
    np.testing.assert_array_equal(got, want)  # Adam's moments and count start over

  loop.train_and_evaluate(tune, str(tmp_path / 'tune'))
  err = capsys.readouterr().err
  assert f'parameters from {tmp_path / "base"} (its step 6); starting at step 0' in err
  rows = metric_rows(tmp_path / 'tune')
  assert [r['step'] for r in rows] == [2, 4]
  # It continues from a trained model: its first window's loss is near the source's last one,
  # far below a fresh model's.
  base_rows = metric_rows(tmp_path / 'base')
  assert rows[0]['loss'] < base_rows[0]['loss'] - 0.2, (rows[0], base_rows)
  with open(tmp_path / 'tune' / 'config.json') as f:
    assert json.load(f)['train']['init_from'] == str(tmp_path / 'base')

  # With checkpoints of its own, the run resumes from them: init_from only seeds step 0.
  tune.train.steps = 6
  loop.train_and_evaluate(tune, str(tmp_path / 'tune'))
  err = capsys.readouterr().err
  assert 'resumed from step 4' in err and 'parameters from' not in err
  assert [r['step'] for r in metric_rows(tmp_path / 'tune')] == [2, 4, 6]


def test_bad_sources_are_refused_in_one_line(data_dir, tmp_path):
  base = _config(data_dir, **{'train.steps': 2, 'train.log_every': 2})
  loop.train_and_evaluate(base, str(tmp_path / 'base'))
  os.makedirs(tmp_path / 'empty')
  wider = _config(data_dir, **{'train.init_from': str(tmp_path / 'base')})
  wider.model.d_ff = 2 * base.model.d_ff
  cases = [
      (str(tmp_path / 'missing'), base, 'is not a directory'),
      (str(tmp_path / 'empty'), base, 'holds no checkpoint'),
      (str(tmp_path / 'base'), wider, r'parameter params/\S*ffn\S* is shape \(\d+, \d+\) in its '
                                      r'checkpoint step 2 but \(\d+, \d+\) in this config'),
  ]
  for source, config, match in cases:
    config = config.copy_and_resolve_references()
    config.train.init_from = source
    with pytest.raises(state_lib.InitFromError, match=match) as e:
      loop.train_and_evaluate(config, str(tmp_path / 'run'))
    assert '\n' not in str(e.value)
