"""Sharded training equals the one-device run; logical axes map to the mesh as the rules say."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from configs import validation
from layers import sharding
import models
from tests.helpers import ROOT, metric_rows, quick_config
import train

MESHES = [(8, 1, 1, 1), (2, 2, 2, 1), (1, 8, 1, 1), (1, 1, 1, 8)]


def run(data_dir, workdir, mesh=(1, 1, 1, 1), **model):
  config = quick_config(data_dir, steps=20, log_every=1, eval_every=100, checkpoint_every=100)
  config.mesh.update(dict(zip(sharding.MESH_AXES, mesh)))
  config.model.update(model)
  validation.validate(config)
  train.train_and_evaluate(config, str(workdir))
  return np.asarray([r['loss'] for r in metric_rows(workdir)])


@pytest.fixture(scope='module')
def one_device(data_dir, tmp_path_factory):
  return run(data_dir, tmp_path_factory.mktemp('one'))


@pytest.mark.parametrize('mesh', MESHES, ids=lambda m: 'x'.join(map(str, m)))
def test_sharded_training_equals_one_device(data_dir, tmp_path, one_device, mesh):
  assert len(jax.devices()) == 8
  losses = run(data_dir, tmp_path, mesh)
  assert len(losses) == 20 and losses[-1] < losses[0]
  np.testing.assert_allclose(losses, one_device, rtol=1e-5)


def test_ring_attention_training_equals_one_device(data_dir, tmp_path, one_device):
  """Context parallelism: 4 sequence shards x 2 data shards, K/V blocks travelling the ring."""
  losses = run(data_dir, tmp_path, (2, 1, 1, 4), attention_impl='ring')
  np.testing.assert_allclose(losses, one_device, rtol=1e-5)


def test_parameters_are_placed_by_their_logical_names():
  config = validation.resolve(default.get_config('quick'))
  config.mesh.update(data=1, fsdp=2, tensor=4, sequence=1)
  mesh = train.make_mesh(config)
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


@pytest.mark.parametrize('mesh,match', [
    ((2, 1, 1, 1), 'must equal the device count 8'),
    ((3, 1, 1, 1), 'must equal the device count 8'),
])
def test_mesh_that_does_not_cover_the_devices_is_one_line(mesh, match):
  config = validation.resolve(default.get_config('quick'))
  config.mesh.update(dict(zip(sharding.MESH_AXES, mesh)))
  with pytest.raises(validation.ConfigError, match=match) as e:
    train.make_mesh(config)
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
  with pytest.raises(validation.ConfigError, match=match):
    validation.validate(config)


def test_two_processes_of_four_devices_equal_one_device(data_dir, tmp_path, one_device):
  """Two local processes (4 CPU devices each) join over gloo on loopback and train one 2x2x2x1 mesh:
  the same losses as one device; only process 0 writes the metrics."""
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=4',
         'JAX_PLATFORMS': 'cpu'}
  args = [sys.executable, os.path.join(ROOT, 'train.py'), '--config=configs/decoder_only.py:quick',
          f'--workdir={tmp_path}', f'--config.data.data_dir={data_dir}',
          '--config.train.steps=20', '--config.train.log_every=1', '--config.train.eval_every=100',
          '--config.train.checkpoint_every=100', '--config.mesh.data=2', '--config.mesh.fsdp=2',
          '--config.mesh.tensor=2', f'--coordinator_address=localhost:{port}', '--num_processes=2']
  procs = [subprocess.Popen(args + [f'--process_id={i}'], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outputs = [p.communicate(timeout=600)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
  losses = np.asarray([r['loss'] for r in metric_rows(tmp_path)])
  assert len(losses) == 20  # one writer
  np.testing.assert_allclose(losses, one_device, rtol=1e-5)
  assert os.path.isdir(tmp_path / 'checkpoints' / '20')


def test_mesh_rules_override_only_the_names_they_list():
  rules = dict(sharding.rules_of({'rules': (('vocab', None), ('mlp', ('tensor', 'fsdp')))}))
  assert rules['vocab'] is None and rules['mlp'] == ('tensor', 'fsdp')
  assert rules['batch'] == ('data', 'fsdp') and rules['heads'] == 'tensor'  # defaults kept
