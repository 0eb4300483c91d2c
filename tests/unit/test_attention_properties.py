"""Property-based (hypothesis): every exact implementation equals the dense reference on random
shapes, lengths, windows, head groupings, segment layouts and masks."""

import functools

from hypothesis import given, settings, strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from layers import attention_blockwise
from layers import attention_pallas
from layers import attention_xla
from tests.helpers import quick_jit

jax.config.update('jax_default_matmul_precision', 'highest')

# derandomize: the same examples on every run (tests stay deterministic).
SETTINGS = dict(deadline=None, derandomize=True)



@st.composite
def problems(draw):
  k = draw(st.sampled_from([1, 2, 4]))
  g = draw(st.sampled_from([1, 2]))
  t = draw(st.integers(1, 40))
  cross = draw(st.booleans())
  s = draw(st.integers(1, 40)) if cross else t
  opts = {
      'is_causal': draw(st.booleans()) and not cross,
      'window': draw(st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(0, 9)))),
      'alibi': draw(st.booleans()),
      'segments': draw(st.integers(0, 3)),  # 0: none, else number of packed segments
      'mask': draw(st.booleans()),
      'block_q': draw(st.sampled_from([4, 8, 16])),
      'block_k': draw(st.sampled_from([4, 8, 16])),
      'seed': draw(st.integers(0, 2 ** 16)),
  }
  return k * g, k, t, s, opts


def _arrays(n, k, t, s, opts):
  rng = np.random.default_rng(opts['seed'])
  q = jnp.asarray(rng.standard_normal((2, t, n, 8), np.float32))
  kk = jnp.asarray(rng.standard_normal((2, s, k, 8), np.float32))
  v = jnp.asarray(rng.standard_normal((2, s, k, 8), np.float32))
  kwargs = {'scale': 8 ** -0.5, 'is_causal': opts['is_causal'], 'window': opts['window']}
  if opts['alibi']:
    kwargs['alibi_slopes'] = jnp.asarray([2.0 ** -(i + 1) for i in range(n)], jnp.float32)
  if opts['segments']:
    kwargs['q_segment_ids'] = jnp.asarray(
        np.sort(rng.integers(0, opts['segments'] + 1, (2, t)), axis=1), jnp.int32)
    kwargs['kv_segment_ids'] = jnp.asarray(
        np.sort(rng.integers(0, opts['segments'] + 1, (2, s)), axis=1), jnp.int32)
  mask = jnp.asarray(rng.random((2, 1, t, s)) > 0.2) if opts['mask'] else None
  return q, kk, v, mask, kwargs


@settings(max_examples=8, **SETTINGS)
@given(problems())
def test_blockwise_equals_reference_forward_and_gradient(problem):
  n, k, t, s, opts = problem
  q, kk, v, mask, kwargs = _arrays(n, k, t, s, opts)
  fast = functools.partial(attention_blockwise.attention, block_q=opts['block_q'],
                           block_k=opts['block_k'], **kwargs)
  ref = functools.partial(attention_xla.attention, **kwargs)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((2, t, n, 8)), jnp.float32)
  loss = lambda f: lambda *a: jnp.sum(f(*a, mask=mask) * w)
  (out, got), (want_out, want) = quick_jit(  # one compilation per example
      lambda *qkv: [(f(*qkv, mask=mask), jax.grad(loss(f), argnums=(0, 1, 2))(*qkv))
                    for f in (fast, ref)])(q, kk, v)
  np.testing.assert_allclose(out, want_out, atol=2e-5)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=5e-5)


@settings(max_examples=3, **SETTINGS)
@given(problems())
def test_pallas_equals_reference_forward(problem):
  n, k, t, s, opts = problem
  q, kk, v, mask, kwargs = _arrays(n, k, t, s, opts)
  out, want = quick_jit(lambda *qkv: (  # one compilation per example
      attention_pallas.attention(*qkv, mask=mask, block_q=opts['block_q'],
                                 block_k=opts['block_k'], **kwargs),
      attention_xla.attention(*qkv, mask=mask, **kwargs)))(q, kk, v)
  np.testing.assert_allclose(out, want, atol=2e-5)
