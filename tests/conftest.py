"""Fixtures shared across test modules, and the simulated devices of the sharding tests."""

import os

# Eight CPU devices for the mesh, ring-attention and sharded-training tests (before jax is
# imported: the flag is read once). Everything else runs on the first device as before.
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """A fresh data dir per module: the toy dataset is generated into it on first use."""
  return tmp_path_factory.mktemp('tfds')
