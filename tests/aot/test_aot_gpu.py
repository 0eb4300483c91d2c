"""The train step compiled for 8 x H100 (Triton kernels) on this CPU host, where jax's CUDA plugin
is installed.

Opt-in: the plugin prints a line ("Could not find cuda drivers") on every JAX start-up without a
GPU, which the one-line error contracts of the CLIs cannot take, so the test extra leaves it out.
Run it from a virtualenv of its own:
`pip install -e '.[test]' "jax-cuda12-plugin==<jax's version>" && pytest tests/aot/test_aot_gpu.py`.
"""

import pytest

from training import aot

aot.quiet_libtpu()
pytest.importorskip('jax_cuda12_plugin', reason='jax-cuda12-plugin is not installed (opt-in)')


from tests.aot import test_aot  # noqa: E402


@pytest.mark.parametrize('mesh', list(test_aot.MESHES))
def test_pallas_steps_compile_for_h100_with_the_triton_kernel(mesh):
  devices = aot.topology_devices('h100:8')
  assert devices[0].device_kind == 'NVIDIA H100 80GB HBM3'
  report = test_aot._compile(test_aot._config('decoder_only', test_aot.MESHES[mesh]), devices)
  triton = {p: r['custom_calls'].get('__gpu$xla.gpu.triton', 0) for p, r in report.items()}
  assert triton == {'train': 6, 'eval': 2, 'decode': 0}
  for r in report.values():
    assert 0 < r['bytes']['total'] < aot.hbm_bytes(devices[0])
