"""`implementation='pallas'` lowered on this CPU host for TPU, GPU and the host itself.

Lowering runs the Pallas backends' own lowering rules (Mosaic's block-shape and op checks, the
Triton lowering), so a change that breaks the TPU or GPU kernel fails here, without an accelerator.
The checks are on the lowered StableHLO's custom calls: `tpu_custom_call` (Mosaic) for tpu,
`__gpu$xla.gpu.triton` for cuda, none for the host (the interpreted kernel is plain HLO).
"""

import re

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from layers import attention
from tests.helpers import quick_jit

B, T, N, H = 1, 200, 4, 64  # T is not a multiple of the 128 tile

OPTIONS = {
    'plain': dict(kv=N),
    'causal_alibi_gqa': dict(kv=2, is_causal=True, alibi=True),
    'window_segments_mqa': dict(kv=1, local_window_size=(64, 16), segments=True),
    'all': dict(kv=2, is_causal=True, local_window_size=(100, 0), alibi=True, segments=True),
}
# One kernel per pallas_call: forward; forward, dQ and dK/dV for the gradient.
KERNELS = {'fwd': 1, 'grad': 3}


def _custom_calls(text):
  return re.findall(r'custom_call @([\w$.]+)', text)


def _traced(option, mode, dtype, dense=False):
  """The jitted fwd (or grad) traced once: every platform's branch is in it; lowering picks one."""
  o = dict(OPTIONS[option])
  kv = o.pop('kv')
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv_shape = jax.ShapeDtypeStruct((B, T, kv, H), dtype)
  if o.pop('alibi', False):
    o['alibi_slopes'] = jnp.linspace(0.5, 0.01, N)
  if o.pop('segments', False):
    o['segment_ids'] = jnp.arange(T, dtype=jnp.int32)[None] // 70
  if dense:
    o['bias'] = jnp.zeros((1, 1, T, T), jnp.float32)

  def loss(q, k, v):
    out = attention.dot_product_attention(q, k, v, implementation='pallas', **o)
    return jnp.sum(out.astype(jnp.float32))

  f = loss if mode == 'fwd' else jax.grad(loss, argnums=(0, 1, 2))
  return jax.jit(f).trace(q, kv_shape, kv_shape)


def _lowered_calls(traced, platform):
  return _custom_calls(traced.lower(lowering_platforms=(platform,)).as_text())


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['f32', 'bf16'])
@pytest.mark.parametrize('mode', list(KERNELS))
@pytest.mark.parametrize('option', list(OPTIONS))
def test_pallas_lowers_to_the_platforms_kernel(option, mode, dtype):
  traced = _traced(option, mode, dtype)
  tpu = _lowered_calls(traced, 'tpu')
  assert tpu == ['tpu_custom_call'] * KERNELS[mode], tpu
  cuda = _lowered_calls(traced, 'cuda')
  assert cuda == ['__gpu$xla.gpu.triton'] * KERNELS[mode], cuda
  assert _lowered_calls(traced, 'cpu') == []


def test_dense_bias_goes_to_blockwise_on_tpu_and_to_triton_on_cuda():
  """The Mosaic kernel takes no [T, S] arrays: with a bias the TPU program is the pure-JAX
  blockwise kernel (no custom call); the Triton kernel takes the bias."""
  traced = _traced('causal_alibi_gqa', 'grad', jnp.float32, dense=True)
  assert _lowered_calls(traced, 'tpu') == []
  cuda = _lowered_calls(traced, 'cuda')
  assert cuda == ['__gpu$xla.gpu.triton'] * 3, cuda


def test_cudnn_lowers_for_cuda_where_jax_allows_it_on_this_host():
  """jax.nn's cuDNN attention checks the installed cuDNN version while it traces, so on a host
  without cuDNN (jax 0.10.2, CPU-only) it cannot be lowered for cuda; documented in
  benchmarks/README.md. Where it can, the program must hold cuDNN's fused attention call."""
  q = jax.ShapeDtypeStruct((B, 256, N, H), jnp.bfloat16)
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='cudnn')
  try:
    text = jax.jit(f).trace(q, q, q).lower(lowering_platforms=('cuda',)).as_text()
  except RuntimeError as e:
    if 'cuDNN is not detected' not in str(e):
      raise
    pytest.skip(f'jax cannot lower cuDNN attention on this host: {e}')
  assert any('cudnn' in c for c in _custom_calls(text)), _custom_calls(text)


@pytest.mark.parametrize('t,h', [(40, 32), (24, 48)])
def test_triton_tiles_are_powers_of_two_for_any_length_and_head_dim(t, h):
  """Triton lowers power-of-two tiles only: a 40-token row or a head dim of 48 is padded to the
  next power of two (the toy task's rows are 40 long), and the numbers stay those of `xla`."""
  q = jax.ShapeDtypeStruct((1, t, N, h), jnp.float32)
  kv = jax.ShapeDtypeStruct((1, t, 2, h), jnp.float32)

  def loss(impl, q, k, v):
    out = attention.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    return jnp.sum(jnp.sin(out))

  grad = lambda impl: jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2))  # noqa: E731
  traced = jax.jit(grad('pallas')).trace(q, kv, kv)
  assert _lowered_calls(traced, 'cuda') == ['__gpu$xla.gpu.triton'] * 3
  rng = np.random.default_rng(0)
  args = [jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in (q, kv, kv)]
  for got, want in zip(quick_jit(grad('pallas'))(*args), quick_jit(grad('xla'))(*args)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
