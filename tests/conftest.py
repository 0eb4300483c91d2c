"""Fixtures shared across test modules, and the simulated devices of the sharding tests."""

import atexit
import os
import shutil
import tempfile

# Eight CPU devices for the mesh, ring-attention and sharded-training tests (before jax is
# imported: the flag is read once). Everything else runs on the first device as before.
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8').strip()

# The test extra installs libtpu (the aot tier compiles for TPU topologies). On a host without an
# accelerator the tests' own programs, subprocesses included, run on the CPU without libtpu's
# start-up probe (5 lines of errors each); a GPU or TPU host keeps its backend.
from training import host

host.cpu_when_no_accelerator()

import pytest  # noqa: E402

# One persistent compilation cache for the session: the integration tests of every xdist worker and
# every train.py/eval.py/sweep subprocess they start (JAX reads these variables at start-up) compile
# the quick configs' train and eval steps again and again; a SIGKILLed-and-resumed run, or two
# processes of one run, find them there (a train.py start on the quick config: 5 s of CPU for the
# compiles, 1.3 s from the cache). The directory is named by the session's first process (the
# workers' parent) and removed when that process exits.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _session = os.getppid() if os.environ.get('PYTEST_XDIST_WORKER') else os.getpid()
  _cache = os.path.join(tempfile.gettempdir(), f'attnlab_test_jax_cache_{_session}')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0.25'  # steps, not single ops
  if not os.environ.get('PYTEST_XDIST_WORKER'):
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """The toy dataset (task 'base'), generated once per test process (one per xdist worker) and
  shared by every test that only reads it, in process or through a train.py/eval.py subprocess:
  `toy_translation.prepare` finds it complete and writes nothing (no lock file either). A test that
  must write into or damage its data dir takes `own_data_dir` instead."""
  from data import toy_translation
  path = tmp_path_factory.mktemp('tfds')
  toy_translation.prepare(str(path), 'base')
  return path


@pytest.fixture
def own_data_dir(data_dir, tmp_path):
  """A private copy of the shared toy dataset (a file copy: cheaper than generating it again)."""
  return shutil.copytree(data_dir, tmp_path / 'tfds')


_compiling_for = [None]  # the tier this process compiles for now: 'unit', 'integration' or 'aot'


def _unit_compile_options():
  """Every program the unit tier compiles, jitted by the tests or inside the library (the real
  train step of the combination cases among them), gets tests.helpers.QUICK_COMPILE's emitters:
  XLA:CPU's elemental emitters instead of its MLIR fusion emitters, half the compile time of these
  tiny programs (the rest of QUICK_COMPILE is what jax_disable_most_optimizations sets)."""
  from jax._src import compiler
  plain = compiler.get_compile_options

  def get_compile_options(*args, env_options_overrides=None, **kwargs):
    if _compiling_for[0] == 'unit':
      env_options_overrides = {'xla_cpu_use_fusion_emitters': False,
                               **(env_options_overrides or {})}
    return plain(*args, env_options_overrides=env_options_overrides, **kwargs)
  compiler.get_compile_options = get_compile_options


_unit_compile_options()


@pytest.hookimpl(tryfirst=True)  # before the fixtures are set up: they compile too
def pytest_runtest_setup(item):
  """This process compiles as the test's tier needs.

  unit: without LLVM's optimisation passes (jax_disable_most_optimizations; the programs it jits
  through tests.helpers.quick_jit get quicker emitters too): its programs are tiny and each runs
  once, so the passes were most of its run time.
  integration: as train.py does, through the session's persistent compilation cache (above).
  aot: as train.py does, without the cache (its programs are for TPU topologies).
  A process leaving the unit tier first drops JAX's in-memory caches, so that no program of
  another tier is a unit-tier build. The unit tier's settings are of this process, not
  environment variables: the subprocesses of the tests compile as train.py always does.
  """
  tier = next((t for t in ('unit', 'integration') if item.get_closest_marker(t)), 'aot')
  if tier == _compiling_for[0]:
    return
  import jax
  from jax.experimental.compilation_cache import (
      compilation_cache)
  if _compiling_for[0] == 'unit':
    jax.clear_caches()
  jax.config.update('jax_disable_most_optimizations', tier == 'unit')
  jax.config.update('jax_enable_compilation_cache', tier == 'integration')
  compilation_cache.reset_cache()  # the cache is looked up again with the settings above
  _compiling_for[0] = tier


def pytest_addoption(parser):
  parser.addoption('--slow', action='store_true',
                   help='also run the tests marked slow (CI leaves them out)')


def pytest_collection_modifyitems(config, items):
  """Every test carries its tier's marker, from its folder: `-m unit` runs the fast tier. The tests
  marked `slow` are deselected unless --slow is given."""
  if not config.getoption('--slow'):
    slow = [item for item in items if item.get_closest_marker('slow')]
    if slow:
      config.hook.pytest_deselected(items=slow)
      items[:] = [item for item in items if not item.get_closest_marker('slow')]
  for item in items:
    parts = item.path.parts
    if 'integration' in parts:
      item.add_marker(pytest.mark.integration)
    elif 'aot' in parts:
      item.add_marker(pytest.mark.aot)
    elif 'unit' in parts:
      item.add_marker(pytest.mark.unit)
