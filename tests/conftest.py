"""Fixtures shared across test modules, and the simulated devices of the sharding tests."""

import os

# Eight CPU devices for the mesh, ring-attention and sharded-training tests (before jax is
# imported: the flag is read once). Everything else runs on the first device as before.
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

# The test extra installs libtpu (the aot tier compiles for TPU topologies). On a host without an
# accelerator the tests' own programs, subprocesses included, run on the CPU without libtpu's
# start-up probe (5 lines of errors each); a GPU or TPU host keeps its backend.
from training import host  # pylint: disable=g-import-not-at-top,wrong-import-position

host.cpu_when_no_accelerator()

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """A fresh data dir per module: the toy dataset is generated into it on first use."""
  return tmp_path_factory.mktemp('tfds')


def pytest_collection_modifyitems(items):
  """Every test carries its tier's marker, from its folder: `-m unit` runs the fast tier."""
  for item in items:
    parts = item.path.parts
    if 'integration' in parts:
      item.add_marker(pytest.mark.integration)
    elif 'aot' in parts:
      item.add_marker(pytest.mark.aot)
    elif 'unit' in parts:
      item.add_marker(pytest.mark.unit)
