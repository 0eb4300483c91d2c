"""Ring attention on 8 simulated CPU devices against the dense `xla` reference: forward and
gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from layers import attention
from tests.helpers import quick_jit

AXES = ('data', 'fsdp', 'tensor', 'sequence')
B, N, H = 2, 4, 16
TOL = 1e-5


MESHES = {
    'seq8': lambda: _mesh((1, 1, 1, 8)),
    'data2_seq4': lambda: _mesh((2, 1, 1, 4)),
    'tensor2_seq4': lambda: _mesh((1, 1, 2, 4)),
    # Auto axes: shard_map reshards the inputs itself (the other meshes are Explicit, the default).
    'fsdp2_seq4_auto': lambda: _mesh((1, 2, 1, 4), (AxisType.Auto,) * 4),
}

CASES = {
    'full_mha': dict(mesh='seq8'),
    'causal_alibi_gqa': dict(mesh='seq8', is_causal=True, alibi=True, kv_heads=2),
    'segments_padding_alibi_gqa': dict(mesh='seq8', segments=True, alibi=True, kv_heads=2),
    'window_causal_mqa': dict(mesh='seq8', local_window_size=(11, 0), is_causal=True, kv_heads=1),
    'cross_T60_S37_window_segments': dict(mesh='seq8', t=60, s=37, local_window_size=(5, 20),
                                          segments=True),
    # Batch split over `data`, the inputs already sharded (the output must keep the query's).
    'data2_seq4_causal_gqa': dict(mesh='data2_seq4', is_causal=True, kv_heads=2, shard_inputs=True),
    # Heads split over `tensor` (N = 4, K = 2): slopes and GQA groups follow their heads.
    'tensor2_seq4_segments_causal_alibi_gqa': dict(mesh='tensor2_seq4', segments=True,
                                                   is_causal=True, alibi=True, kv_heads=2),
    'fsdp2_seq4_auto_cross_T64_S32_causal_alibi': dict(mesh='fsdp2_seq4_auto', t=64, s=32,
                                                       is_causal=True, alibi=True),
}


def _mesh(shape, axis_types=None):
  return jax.make_mesh(shape, AXES, axis_types=axis_types)


def _inputs(t, s, kv_heads, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, t, N, H), np.float32)
  k = rng.standard_normal((B, s, kv_heads, H), np.float32)
  v = rng.standard_normal((B, s, kv_heads, H), np.float32)
  ct = rng.standard_normal((B, t, N, H), np.float32)
  return [jnp.asarray(x) for x in (q, k, v, ct)]


def _value_and_grads(impl, q, k, v, ct, **kwargs):
  """Output and the vjp of `ct` w.r.t. q, k, v, in one jit."""

  @quick_jit
  def run(q, k, v, ct):
    def f(q, k, v):
      return attention.dot_product_attention(q, k, v, implementation=impl, **kwargs)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)

  return run(q, k, v, ct)


def _segments(t, s):
  """Packed rows plus padding. Row 0: two segments, then padding (id 0) in the queries only, so
  its last queries see no key (their output must be zeros). Row 1: one segment, key padding at the
  end that no query shares."""
  q_seg = np.ones((B, t), np.int32)
  kv_seg = np.ones((B, s), np.int32)
  q_seg[0, t // 3:] = 2
  kv_seg[0, s // 3:] = 2
  q_seg[0, -t // 4:] = 0
  kv_seg[1, -s // 5:] = 3
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)


@pytest.mark.parametrize('case', list(CASES))
def test_matches_dense(case):
  cfg = dict(CASES[case])
  mesh = MESHES[cfg.pop('mesh')]()
  t, s = cfg.pop('t', 64), cfg.pop('s', 64)
  kv_heads = cfg.pop('kv_heads', N)
  shard_inputs = cfg.pop('shard_inputs', False)
  q, k, v, ct = _inputs(t, s, kv_heads)
  if cfg.pop('alibi', False):
    cfg['alibi_slopes'] = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
  if cfg.pop('segments', False):
    cfg['segment_ids'] = _segments(t, s)
  want_out, want_grads = _value_and_grads('xla', q, k, v, ct, **cfg)
  with jax.set_mesh(mesh):
    if shard_inputs:
      q, k, v, ct = (jax.sharding.reshard(x, jax.P('data', 'sequence')) for x in (q, k, v, ct))
    out, grads = _value_and_grads('ring', q, k, v, ct, **cfg)
  if shard_inputs:
    assert jax.typeof(out).sharding.spec == jax.typeof(q).sharding.spec
  assert out.shape == want_out.shape
  errors = {name: float(jnp.max(jnp.abs(a - b))) for name, a, b in
            zip(('out', 'dq', 'dk', 'dv'), (out, *grads), (want_out, *want_grads))}
  print(case, errors)
  assert max(errors.values()) < TOL, errors
  assert all(np.isfinite(np.asarray(x)).all() for x in (out, *grads))
  if 'segment_ids' in cfg:
    # Row 0's padding queries have no key of their segment: zeros, not NaN or a uniform average.
    empty = np.asarray(cfg['segment_ids'][0][0] == 0)
    assert empty.any()
    np.testing.assert_array_equal(np.asarray(out[0, empty]), 0.0)


def _temp_bytes(mesh, t):
  """Compiled temp memory per device of the causal forward+backward at T = S = t (None: unknown)."""
  q, k, v, ct = (jax.ShapeDtypeStruct(x.shape[:1] + (t,) + x.shape[2:], x.dtype)
                 for x in _inputs(8, 8, N))

  def loss(q, k, v, ct):
    out = attention.dot_product_attention(q, k, v, is_causal=True, implementation='ring')
    return jnp.sum(out * ct)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v, ct).compile()
  stats = compiled.memory_analysis()
  return None if stats is None else stats.temp_size_in_bytes


def test_per_device_memory_is_one_block():
  """Per-device temp memory scales as the [T/P, S/P] block, not a [T/P, S] stripe or [T, S].

  Halving the ring (P = 8 -> 4) at fixed T = S = 2048 makes the block 4x larger but a stripe only
  2x; and one [T/P, S] stripe of float32 scores (B*N*256*2048*4 = 16 MiB at P = 8) is more than the
  ring holds in all (a few [T/P, S/P] blocks of 2 MiB are live at once in the backward pass).
  """
  t = 2048
  ring8 = _temp_bytes(MESHES['seq8'](), t)
  ring4 = _temp_bytes(_mesh((1, 1, 1, 4)), t)
  if ring8 is None or ring4 is None:
    pytest.skip('no memory analysis on this backend')
  print('temp bytes per device: P=8', ring8, 'P=4', ring4)
  assert ring8 < B * N * (t // 8) * t * 4, ring8
  assert ring4 > 3 * ring8, (ring4, ring8)


def test_errors():
  q, k, v, _ = _inputs(64, 64, N)
  with pytest.raises(ValueError, match=r'config\.mesh\.sequence > 1'):
    attention.dot_product_attention(q, k, v, implementation='ring')  # no mesh at all
  with jax.set_mesh(_mesh((1, 1, 8, 1))):
    with pytest.raises(ValueError, match=r'config\.mesh\.sequence > 1'):
      attention.dot_product_attention(q, k, v, implementation='ring')
  with jax.set_mesh(MESHES['seq8']()):
    # The kernel table refuses the terms ring does not declare before it is called.
    with pytest.raises(ValueError, match=r"^implementation='ring' cannot take a dense \[T, S\] "
                                         'bias; valid: blockwise, cudnn, pallas, xla$'):
      attention.dot_product_attention(q, k, v, bias=jnp.zeros((64, 64)), implementation='ring')
    with pytest.raises(ValueError, match=r"^implementation='ring' cannot take a \[T, S\] mask; "
                                         'valid: blockwise, cudnn, pallas, xla$'):
      attention.dot_product_attention(q, k, v, mask=jnp.ones((64, 64), bool),
                                      implementation='ring')
    # ... and ring itself, called directly.
    with pytest.raises(ValueError, match='no dense bias/mask'):
      attention.KERNELS['ring'].fn(q, k, v, bias=jnp.zeros((64, 64)), scale=1.0)
