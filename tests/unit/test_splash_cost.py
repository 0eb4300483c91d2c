"""The cost estimates splash's calls carry (`layers.attention_splash_cost`): each of the forward,
dQ and dK/dV calls in a gradient's program counts the (query block, key block) pairs its mask
leaves non-empty, checked against a plain count of the blocks of the dense mask; jax's module is
left as it was. Traced only (make_jaxpr, interpret mode): nothing runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel

from layers import attention_splash
from layers import attention_splash_cost

B, T, N, K, H = 2, 640, 4, 2, 16  # five 128-blocks a row; GQA
BLOCK = attention_splash.BLOCK
PRODUCTS = {'fwd': 2, 'dq': 3, 'dkv': 4}  # matrix products per block pair
ONCE = {'fwd': 2, 'dq': 3, 'dkv': 4}  # [B, N, T, H] arrays read or written once


def _pallas_calls(jaxpr):
  """(name, cost_estimate) of every pallas_call in `jaxpr` and the jaxprs inside it."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'pallas_call':
      found.append((eqn.params['name'], eqn.params['cost_estimate']))
    for param in eqn.params.values():
      inner = getattr(param, 'jaxpr', param)
      if hasattr(inner, 'eqns'):
        found += _pallas_calls(inner)
  return found


def _plain_blocks(is_causal, window):
  """Block pairs of one head with at least one visible (query, key): the dense [T, T] mask cut
  into 128 x 128 blocks."""
  i, j = np.arange(T)[:, None], np.arange(T)[None]
  visible = np.ones((T, T), bool)
  if is_causal:
    visible &= j <= i
  if window is not None:
    visible &= (j >= i - window[0]) & (j <= i + window[1])
  n = T // BLOCK
  return int(visible.reshape(n, BLOCK, n, BLOCK).any(axis=(1, 3)).sum())


@pytest.mark.parametrize('is_causal,window', [(True, None), (True, (200, 0)), (False, (100, 300))])
def test_each_call_counts_the_blocks_its_mask_visits(is_causal, window):
  q = jnp.ones((B, T, N, H), jnp.float32)
  kv = jnp.ones((B, T, K, H), jnp.float32)

  def out(q, k, v):
    return attention_splash.attention(q, k, v, scale=0.25, is_causal=is_causal, window=window,
                                      interpret=True)

  train = _pallas_calls(jax.make_jaxpr(jax.grad(lambda *a: out(*a).sum(), (0, 1, 2)))(q, kv, kv))
  forward = _pallas_calls(jax.make_jaxpr(out)(q, kv, kv))
  assert sorted(attention_splash_cost.phase_of(name) for name, _ in train) == ['dkv', 'dq', 'fwd']
  assert [attention_splash_cost.phase_of(name) for name, _ in forward] == ['fwd']
  tiles = _plain_blocks(is_causal, window) * B * N  # every row and query head
  assert tiles < (T // BLOCK) ** 2 * B * N  # the band: fewer than every block
  for name, cost in train + forward:
    phase = attention_splash_cost.phase_of(name)
    pairs = tiles * BLOCK * BLOCK
    assert cost.flops == 2 * PRODUCTS[phase] * pairs * H
    assert cost.transcendentals == pairs
    assert cost.bytes_accessed == 4 * H * (ONCE[phase] * B * N * T + 2 * tiles * BLOCK)


def test_jax_module_is_restored_and_unknown_calls_are_refused():
  q = jnp.ones((1, BLOCK, 2, H), jnp.float32)
  jax.make_jaxpr(lambda q: attention_splash.attention(q, q, q, scale=0.25, is_causal=True,
                                                      interpret=True))(q)
  assert splash_attention_kernel.pl is pallas
  with pytest.raises(ValueError, match="'flash_forward_tpu': not a kernel name"):
    attention_splash_cost.phase_of('flash_forward_tpu')
