"""jax's TPU splash kernel (`attention_impl='splash'`) run in Pallas's TPU interpret mode against a
float64 reference: output and the gradients of q, k, v (and the sink logits), causal, windowed,
with segment ids, the logit soft cap, sinks, GQA and MQA, at a scale that is not 1/sqrt(H) (splash
scores q·k unscaled: the wrapper scales q); through `dot_product_attention` under shard_map on a
CPU mesh; the cached decode (xla's step) equals the full forward through splash; refused off TPU
in one line, accepted for a TPU target (tools.aot's `compiling_for`).

The interpreter is slow: one or two batch rows, few heads, lengths of two or three 128-blocks (not
multiples of 128: the last block is padded and masked)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import attention
from layers import attention_sharded
from layers import attention_splash
from layers import options
from tests.helpers import quick_jit
from tests.unit import test_softcap_sinks
from tests.unit.test_decoding import full_and_cached_logits
from tests.unit.test_attention_sharded import _mesh
from training import validation

H = 16
SCALE = 0.3  # not 1/sqrt(H) = 0.25: a kernel that scaled twice, or not at all, is caught
TOL = dict(atol=1e-5, rtol=1e-5)  # float32 against float64 (the errors are <= 1.4e-6)

CASES = {
    # b, t, s, n, kv, options
    'causal_gqa_T200': (1, 200, 200, 4, 2, dict(is_causal=True)),
    # 3 query blocks, a band of ~1 key block each: splash skips the others.
    'causal_window_mqa_T300': (1, 300, 300, 2, 1, dict(is_causal=True, window=(40, 40))),
    'window_both_sides_T300': (1, 300, 300, 2, 2, dict(window=(30, 70))),
    'causal_segments_softcap_sinks_gqa': (2, 200, 200, 4, 2, dict(
        is_causal=True, segments=True, softcap=1.5, sinks=True)),
    'cross_T100_S200': (1, 100, 200, 2, 1, {}),
}


def _reference(q, k, v, sinks, *, scale=SCALE, is_causal=False, window=None, q_seg=None,
               kv_seg=None, softcap=None):
  """The definition, in the inputs' precision: s = scale·q·k (capped: c·tanh(s / c)), hidden keys
  dropped, p = exp(s) / (exp(sink) + sum exp(s)) (no sink: the plain softmax), out = p @ v."""
  t, s, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # query head n reads KV head n // G
  logits = jnp.einsum('btnh,bsnh->bnts', q, k) * scale  # [B, N, T, S]
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  i, j = np.arange(t)[:, None], np.arange(s)[None]
  vis = np.ones((1, 1, t, s), bool)
  if is_causal:
    vis = vis & (j <= i)
  if window is not None:
    vis = vis & (j >= i - window[0]) & (j <= i + window[1])
  if q_seg is not None:
    vis = vis & (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  m = jnp.max(jnp.where(vis, logits, -jnp.inf), -1)  # [B, N, T]
  if sinks is not None:
    m = jnp.maximum(m, sinks[:, None])
  e = jnp.where(vis, jnp.exp(logits - m[..., None]), 0.0)
  denom = e.sum(-1) + (0.0 if sinks is None else jnp.exp(sinks[:, None] - m))  # [B, N, T]
  return jnp.einsum('bnts,bsnh->btnh', e / denom[..., None], v)


def _case(name):
  b, t, s, n, kv, opts = CASES[name]
  opts = dict(opts)
  rng = np.random.default_rng(0)
  arrays = [rng.standard_normal(shape).astype(np.float32)
            for shape in ((b, t, n, H), (b, s, kv, H), (b, s, kv, H), (b, t, n, H))]
  sinks = rng.standard_normal(n).astype(np.float32) if opts.pop('sinks', False) else None
  if opts.pop('segments', False):
    seg = (np.arange(t)[None] // 70 + np.arange(b)[:, None]).astype(np.int32)  # [B, T]
    opts.update(q_seg=seg, kv_seg=seg)
  return arrays, sinks, opts


def _want(arrays, sinks, opts):
  """Output and the vjp of the cotangent w.r.t. q, k, v (and the sinks): float64."""
  with jax.enable_x64(True):
    q, k, v, ct = (jnp.asarray(a, jnp.float64) for a in arrays)
    s64 = None if sinks is None else jnp.asarray(sinks, jnp.float64)
    out, vjp = jax.vjp(functools.partial(_reference, **opts), q, k, v, s64)
    return np.asarray(out), [np.asarray(g) for g in vjp(ct) if g is not None]


def _got(fn, arrays, sinks):
  q, k, v, ct = (jnp.asarray(a) for a in arrays)

  @quick_jit
  def run(q, k, v, sinks, ct):
    out, vjp = jax.vjp(fn, q, k, v, sinks)
    return out, [g for g in vjp(ct) if g is not None]

  return run(q, k, v, None if sinks is None else jnp.asarray(sinks), ct)


def _check(got, want):
  np.testing.assert_allclose(got[0], want[0], err_msg='out', **TOL)
  assert len(got[1]) == len(want[1])
  for name, g, w in zip(('dq', 'dk', 'dv', 'dsinks'), got[1], want[1]):
    np.testing.assert_allclose(g, w, err_msg=name, **TOL)


@pytest.mark.parametrize('case', list(CASES))
def test_splash_interpreted_matches_the_float64_reference(case):
  arrays, sinks, opts = _case(case)
  kw = dict(scale=SCALE, is_causal=opts.get('is_causal', False), window=opts.get('window'),
            softcap=opts.get('softcap'))
  if 'q_seg' in opts:
    kw.update(q_segment_ids=jnp.asarray(opts['q_seg']), kv_segment_ids=jnp.asarray(opts['kv_seg']))

  def fn(q, k, v, sinks):
    return attention_splash.attention(q, k, v, sinks=sinks, interpret=True, **kw)

  _check(_got(fn, arrays, sinks), _want(arrays, sinks, opts))


def test_the_masks_are_the_band_splash_skips_outside():
  """Causal: the lower triangle of blocks; a causal window of 40 on 3 blocks: the diagonal and the
  one below it; no mask: every block (FullMask)."""
  def blocks(mask):
    dense = np.asarray(mask.masks[0][:, :])  # [T, S]
    return dense.reshape(3, 128, 3, 128).any(axis=(1, 3))
  np.testing.assert_array_equal(blocks(attention_splash._mask(384, 384, 2, True, None)),
                                np.tril(np.ones((3, 3), bool)))
  np.testing.assert_array_equal(blocks(attention_splash._mask(384, 384, 2, True, (40, 40))),
                                np.eye(3, dtype=bool) | np.eye(3, k=-1, dtype=bool))
  assert blocks(attention_splash._mask(384, 384, 2, False, None)).all()


def test_through_dot_product_attention_on_a_mesh(monkeypatch):
  """The registered kernel (per device under shard_map: batch over fsdp, heads over tensor) with
  scale=None (1/sqrt(H)) and packed segment ids, interpreted, for a TPU target."""
  interpreted = attention_sharded.per_device(
      functools.partial(attention_splash.attention, interpret=True))
  monkeypatch.setitem(attention.KERNELS, 'splash', dataclasses.replace(
      attention.KERNELS['splash'], fn=interpreted))
  arrays, sinks, opts = _case('causal_segments_softcap_sinks_gqa')

  def fn(q, k, v, sinks):
    return attention.dot_product_attention(
        q, k, v, is_causal=True, segment_ids=jnp.asarray(opts['q_seg']), softcap=opts['softcap'],
        sinks=sinks, implementation='splash')

  with attention.compiling_for('tpu'), jax.set_mesh(_mesh((1, 2, 2, 1))):
    got = _got(fn, arrays, sinks)
  _check(got, _want(arrays, sinks, dict(opts, scale=1.0 / np.sqrt(H))))


def _config(**model):
  config = default.get_config('quick')
  config.model.update(attention_impl='splash', **model)
  return validation.resolve(config)


def test_refused_off_tpu_in_one_line_and_accepted_for_a_tpu_target():
  with pytest.raises(options.ConfigError) as e:
    validation.validate(_config())
  assert str(e.value) == ("model.attention_impl='splash' needs tpu; valid here (cpu): xla, "
                          'blockwise, pallas, ring')
  with attention.compiling_for('tpu'):
    validation.validate(_config(attn_logit_softcap=30.0, attention_sinks=True, num_kv_heads=1))
  with pytest.raises(ValueError, match="implementation='splash' runs on tpu, not cpu"):
    attention.dot_product_attention(*(jnp.zeros((1, 8, 2, H)),) * 3, implementation='splash')


def test_cached_decoding_equals_the_full_forward_through_splash(monkeypatch):
  """A decoder-only model (RoPE, GQA, soft cap, sinks) whose full forward runs splash
  (interpreted) and whose cached step runs `xla`'s (splash does not decode): the same logits."""
  monkeypatch.setitem(attention.KERNELS, 'splash', dataclasses.replace(
      attention.KERNELS['splash'], fn=functools.partial(attention_splash.attention,
                                                        interpret=True)))
  config = test_softcap_sinks._config(attention_impl='splash')
  with attention.compiling_for('tpu'):
    validation.validate(config)
    model = test_softcap_sinks._with_sinks(models.build(config.model, test_softcap_sinks.V, 16,
                                                        rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, test_softcap_sinks.V)
    full, cached = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
