"""Sharded training equals the one-device run; logical axes map to the mesh as the rules say."""


import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from training import validation
from layers import options
from layers import sharding
import models
from training import distributed
from training import state as state_lib


def test_parameters_are_placed_by_their_logical_names():
  config = validation.resolve(default.get_config('quick'))
  config.mesh.update(data=1, fsdp=2, tensor=4, sequence=1)
  mesh = distributed.make_mesh(config)
  model = models.build(config.model, 166, 40, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  specs = sharding.param_specs(params, mesh, sharding.rules_of(config.mesh))
  block = specs['decoder']['blocks'][0]
  P = jax.sharding.PartitionSpec
  assert block['self_attention']['query']['kernel'].value == P('fsdp', 'tensor', None)
  assert block['self_attention']['out']['kernel'].value == P('tensor', None, 'fsdp')
  assert block['ffn']['wi']['kernel'].value == P('fsdp', 'tensor')
  # A dimension the mesh axis does not divide is replicated, not refused: the vocabulary (166
  # tokens over tensor=4), MQA's single KV head.
  assert specs['decoder']['embed']['embedding'].value == P(None, 'fsdp')
  kv = sharding.spec(('embed', 'kv_heads', 'head_dim'), (64, 1, 16), mesh, sharding.DEFAULT_RULES)
  assert kv == P('fsdp', None, None)


def test_state_is_initialised_into_its_shardings_with_the_one_device_values():
  """create_state on a mesh builds the parameters inside jit, each device only its shards; the
  values are those of the plain (unsharded) initialisation."""
  config = validation.resolve(default.get_config('quick'))
  _, _, plain = state_lib.create_state(config, 166)
  config.mesh.update(data=1, fsdp=2, tensor=4, sequence=1)
  mesh = distributed.make_mesh(config)
  with jax.transfer_guard_device_to_device('disallow'):  # nothing built on one device, then moved
    _, _, placed = state_lib.create_state(config, 166, mesh)
  kernel = placed['params']['decoder']['blocks'][0]['ffn']['wi']['kernel'].value
  assert kernel.sharding.spec == jax.sharding.PartitionSpec('fsdp', 'tensor')
  assert {s.data.shape for s in kernel.addressable_shards} == {
      (kernel.shape[0] // 2, kernel.shape[1] // 4)}
  for a, b in zip(jax.tree.leaves(plain['params']), jax.tree.leaves(placed['params'])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('mesh,match', [
    ((2, 1, 1, 1), 'must equal the device count 8'),
    ((3, 1, 1, 1), 'must equal the device count 8'),
])
def test_mesh_that_does_not_cover_the_devices_is_one_line(mesh, match):
  config = validation.resolve(default.get_config('quick'))
  config.mesh.update(dict(zip(sharding.MESH_AXES, mesh)))
  with pytest.raises(options.ConfigError, match=match) as e:
    distributed.make_mesh(config)
  assert '\n' not in str(e.value) and 'mesh.data' in str(e.value)


@pytest.mark.parametrize('field,value,match', [
    ('data', 0, 'mesh.data'),
    ('rules', (('nonsense', 'data'),), 'mesh.rules'),
    ('rules', (('batch', 'pipeline'),), 'not a mesh axis'),
    ('fsdp', 3, 'train.batch_size'),
])
def test_bad_mesh_fields_are_config_errors(field, value, match):
  config = validation.resolve(default.get_config('quick'))
  config.mesh[field] = value
  with pytest.raises(options.ConfigError, match=match):
    validation.validate(config)


@pytest.mark.parametrize('mesh,shards,expected', [
    ((2, 2, 2, 1), 4, [range(0, 2), range(2, 4)]),  # rows over data x fsdp: a block per host
    ((1, 8, 1, 1), 8, [range(0, 4), range(4, 8)]),
    ((1, 1, 1, 8), 4, [range(0, 4), range(0, 4)]),  # the batch replicated: every host reads all
])
def test_each_host_reads_the_shards_of_its_rows(mesh, shards, expected):
  """Hosts = the two halves of the mesh's devices (4 each, as in the two-process test)."""
  config = validation.resolve(default.get_config('quick'))
  config.mesh.update(dict(zip(sharding.MESH_AXES, mesh)))
  config.data.shards = shards
  m = distributed.make_mesh(config)
  rules = sharding.rules_of(config.mesh)
  devices = m.devices.flatten()
  hosts = [devices[:4], devices[4:]]
  assert [distributed.data_shards(config, m, rules, host) for host in hosts] == expected


@pytest.mark.parametrize('value', [0, -2, 3])
def test_bad_data_shards_is_a_config_error(value):
  config = validation.resolve(default.get_config('quick'))
  config.data.shards = value
  with pytest.raises(options.ConfigError, match=r'data.shards=.*train.batch_size'):
    validation.validate(config)


def test_mesh_rules_override_only_the_names_they_list():
  rules = dict(sharding.rules_of({'rules': (('vocab', None), ('mlp', ('tensor', 'fsdp')))}))
  assert rules['vocab'] is None and rules['mlp'] == ('tensor', 'fsdp')
  assert rules['batch'] == ('data', 'fsdp', 'expert') and rules['heads'] == 'tensor'  # defaults
