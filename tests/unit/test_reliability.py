"""Faults and bad input: signals, damaged checkpoints, changed configs, NaNs, determinism, and the
catalogue of invalid configs (each one line naming the field, exit code 2, no traceback)."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import decoder_only
from configs import default
from layers import options
from training import validation
from training import checkpointing
from training import state as state_lib


CATALOGUE = [
    ('model.num_heads', 7), ('model.num_kv_heads', 3), ('model.arch', 'rnn'),
    ('model.attention', 'sparse'), ('model.attention_impl', 'triton'), ('model.position', 'rotary'),
    ('model.norm', 'batchnorm'), ('model.norm_position', 'middle'), ('model.ffn', 'tanh'),
    ('model.num_layers', 0), ('model.d_model', -8), ('model.num_heads', 0), ('model.d_ff', -1),
    ('model.dropout', 1.5), ('model.rope_scaling', 'linear'), ('model.rope_base', 0.5),
    ('model.rope_fraction', 0.0), ('model.t5_num_buckets', 3), ('train.steps', 0),
    ('train.batch_size', 0), ('train.learning_rate', 0.0), ('train.learning_rate', -1e-3),
    ('train.warmup_steps', 5000), ('train.warmup_steps', -1), ('train.schedule', 'step'),
    ('train.loss_on', 'source'), ('train.grad_clip_norm', -1.0), ('train.b2', 1.0),
    ('train.checkpoint_every', 0), ('train.log_every', 0), ('data.packing', 'greedy'),
    ('data.task', 'nosuch'), ('data.max_length', 4),
    # Non-finite and empty values, accepted before the reliability pass.
    ('train.learning_rate', float('nan')), ('train.learning_rate', float('inf')),
    ('train.weight_decay', float('nan')), ('train.weight_decay', float('inf')),
    ('model.rope_scaling_factor', float('nan')), ('model.rope_scaling_factor', float('inf')),
    ('model.rope_base', float('inf')), ('model.rope_base', float('nan')),
    ('train.grad_clip_norm', float('nan')), ('train.grad_clip_norm', float('inf')),
    ('data.data_dir', ''), ('data.data_dir', '  '),
]


@pytest.mark.parametrize('field,value', CATALOGUE, ids=[f'{f}={v!r}' for f, v in CATALOGUE])
def test_bad_config_names_the_field(field, value):
  config = validation.resolve(decoder_only.get_config())
  section, name = field.split('.')
  config[section][name] = value
  with pytest.raises(options.ConfigError, match=field.replace('.', r'\.')) as e:
    validation.validate(config)
  assert '\n' not in str(e.value)


def test_catalogue_is_at_least_thirty():
  assert len(CATALOGUE) >= 30


def test_checkpoint_written_before_model_buffers_existed_still_restores(tmp_path):
  """Runs saved before `state['buffers']` existed (no entry in the checkpoint) restore into a model
  without buffers; the config fields added since (at their defaults) do not block the resume."""
  config = validation.resolve(default.get_config('quick'))
  graphdef, _, state = state_lib.create_state(config, 166)
  old = {k: v for k, v in state.items() if k != 'buffers'}
  mngr = checkpointing.checkpoint_manager(str(tmp_path), config)
  mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(old),
                                       data=ocp.args.JsonSave({'position': 0})))
  mngr.wait_until_finished()
  restored, data_state = checkpointing.restore_state(mngr, state)
  mngr.close()
  assert data_state == {'position': 0} and not jax.tree.leaves(restored['buffers'])
  jax.tree.map(np.testing.assert_array_equal, restored['params'], state['params'])
  flat = json.loads(config.to_json_best_effort())
  del flat['mesh'], flat['train']['grad_accum_steps']  # fields an older attnlab did not write
  (tmp_path / 'config.json').write_text(json.dumps(flat))
  assert checkpointing.check_resume_config(str(tmp_path), config) == []
