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


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """The toy dataset (task 'base'), generated once per test process (one per xdist worker) and
  shared by every test that only reads it, in process or through a train.py/eval.py subprocess:
  `toy_translation.prepare` finds it complete and writes nothing (no lock file either). A test that
  must write into or damage its data dir takes `own_data_dir` instead."""
  from data import toy_translation  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp('tfds')
  toy_translation.prepare(str(path), 'base')
  return path


@pytest.fixture
def own_data_dir(data_dir, tmp_path):
  """A private copy of the shared toy dataset (a file copy: cheaper than generating it again)."""
  import shutil  # pylint: disable=g-import-not-at-top
  return shutil.copytree(data_dir, tmp_path / 'tfds')


_unit_compiles = [False]  # whether this process now compiles as the unit tier does


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up: they compile too
def pytest_runtest_setup(item):
  """The unit tier compiles without LLVM's optimisation passes (jax_disable_most_optimizations; the
  programs it jits through tests.helpers.quick_jit get quicker emitters too): its programs are tiny
  and each runs once, so the passes were most of its run time. The other tiers compile as train.py
  does; a process that goes on from unit tests to others first drops JAX's caches, so that none of
  their programs is a unit-tier build. (A setting of this process, not an environment variable:
  the subprocesses of the tests keep the default.)"""
  unit = item.get_closest_marker('unit') is not None
  if unit == _unit_compiles[0]:
    return
  import jax  # pylint: disable=g-import-not-at-top
  if not unit:
    jax.clear_caches()
  jax.config.update('jax_disable_most_optimizations', unit)
  _unit_compiles[0] = unit


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
