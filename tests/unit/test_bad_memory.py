"""The memory check before compiling: the estimate (state plus activations) against a device's
limit, refused in one line; CPU devices of one mesh share the host's memory; XLA's own
out-of-memory error becomes one line with the estimate."""

import jax
import pytest

from configs import decoder_only
from models import accounting
from training import memory
from training import validation

GIB = 2 ** 30


def huge_config(**mesh):
  config = validation.resolve(decoder_only.get_config('quick'))
  config.model.d_model = 16384  # ~2.1e9 parameters in two layers: 32 GiB of float32 state
  config.mesh.update(mesh)
  validation.validate(config)
  return config


def test_the_estimate_is_state_plus_activations():
  config = huge_config()
  need = memory.estimate(config, 166)
  counted = sum(accounting.counted_params(accounting.abstract_model(
      config.model, 166, config.data.max_length)).values())
  assert need['state'] == 4 * 4 * counted  # params, grads and two Adam moments, float32
  assert need['activations'] == accounting.activation_bytes(
      config.model, 166, config.train.batch_size, config.data.max_length, config.mesh)
  assert need['total'] == need['state'] + need['activations'] > 32 * GIB


def test_an_estimate_over_the_limit_is_refused_in_one_line():
  config = huge_config()
  with pytest.raises(memory.OutOfMemory) as e:
    memory.check_training_memory(config, 166, limit=(8 * GIB, 'test limit'))
  message = str(e.value)
  assert '\n' not in message
  assert message.startswith('out of memory: estimated training memory 32.')
  assert 'limit 8.0 GiB (test limit)' in message and 'mesh.fsdp' in message
  small = validation.resolve(decoder_only.get_config('quick'))
  need, limit, what = memory.check_training_memory(small, 166, limit=(8 * GIB, 'test limit'))
  assert need['total'] < 8 * GIB and (limit, what) == (8 * GIB, 'test limit')


def test_cpu_devices_of_one_mesh_share_the_host_limit():
  config = huge_config(fsdp=4)  # needs 4 of the 8 simulated CPU devices
  per_device = memory.estimate(config, 166)['total']
  memory.check_training_memory(config, 166, limit=(4 * per_device, 'host'))
  with pytest.raises(memory.OutOfMemory, match='x 4 devices sharing the host'):
    memory.check_training_memory(config, 166, limit=(4 * per_device - 1, 'host'))


def test_the_device_limit_on_cpu_is_the_host_memory():
  limit, what = memory.device_limit()
  assert jax.local_devices()[0].memory_stats() is None  # a CPU: no allocator limit
  assert limit > 0
  assert what in ('available host memory', 'room under the cgroup memory limit') or what.startswith(
      'address space left under RLIMIT_AS'), what


def test_an_xla_out_of_memory_error_is_one_line_with_the_estimate():
  error = jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory allocating 1073741824 '
                                     'bytes.\nmore lines of XLA detail')
  assert memory.is_out_of_memory(error) and memory.is_out_of_memory(MemoryError())
  assert not memory.is_out_of_memory(RuntimeError('INTERNAL: something else'))
  line = memory.out_of_memory_line(error, huge_config(), 166)
  assert '\n' not in line
  assert line.startswith('train: out of memory: RESOURCE_EXHAUSTED: Out of memory allocating '
                         '1073741824 bytes.; estimated training memory 32.')


def test_meminfo_reads_kilobytes(tmp_path):
  path = tmp_path / 'meminfo'
  path.write_text('MemTotal:       24684092 kB\nMemAvailable:   1000 kB\n')
  assert memory._meminfo('MemAvailable', str(path)) == 1000 * 1024
  assert memory._meminfo('Nope', str(path)) is None
