"""The attention logit soft cap (Gemma 2) and attention sinks (GPT-OSS) in every kernel that takes
them (xla, blockwise, the Pallas Triton kernel and the Mosaic one interpreted, ring on a 2-device
sequence mesh): output and gradients of q, k, v and the sink logits against jax.grad of a float64
reference; the cached decode equals the full forward pass; the parameters are counted; the
refusals are one line."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import attention
from layers import attention_blockwise
from layers import attention_pallas
from layers import attention_pallas_tpu
from layers import attention_xla
from layers import options
from models import accounting
from tests.helpers import quick_jit
from tests.unit.test_decoding import enc_dec_batch
from tests.unit.test_decoding import full_and_cached_logits
from training import validation

B, N, H = 2, 4, 8
SCALE = 1.0 / np.sqrt(H)
CAP = 1.5  # scores of std ~1 reach ~4: the cap bends them
SINKS = np.array([-1.0, 0.5, 2.0, 0.0], np.float32)  # [N]
TOL = dict(atol=1e-5, rtol=1e-5)  # float32, as tests/unit/test_attention_kernels.py
V = 23

CASES = {
    'causal_gqa': dict(t=21, s=21, kv=2, is_causal=True),
    # Queries 18.. are in a segment no key has: their rows see no key (zeros out of the sink).
    'window_segments_mqa': dict(t=21, s=21, kv=1, window=(5, 2), segments=True),
    'cross_T12_S20_gqa': dict(t=12, s=20, kv=2),
}


def _case(name):
  c = dict(CASES[name])
  rng = np.random.default_rng(0)
  t, s, kv = c.pop('t'), c.pop('s'), c.pop('kv')
  arrays = [rng.standard_normal(shape).astype(np.float32)
            for shape in ((B, t, N, H), (B, s, kv, H), (B, s, kv, H), (B, t, N, H))]
  kw = dict(is_causal=c.pop('is_causal', False), window=c.pop('window', None))
  if c.pop('segments', False):
    q_seg = (np.arange(t)[None] // 7 + np.array([[0], [1]])).astype(np.int32)  # [B, T]
    q_seg[:, 18:] = 99
    kv_seg = (np.arange(s)[None] // 7 + np.array([[0], [1]])).astype(np.int32)  # [B, S]
    kw.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  return arrays, kw


def _reference(q, k, v, sinks, *, is_causal, window, q_segment_ids=None, kv_segment_ids=None):
  """The definition, in whatever precision the inputs have: s = CAP·tanh(q·k·scale / CAP), hidden
  keys dropped, p = exp(s) / (exp(sink) + sum exp(s)), out = p @ v."""
  t, s, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # query head n reads KV head n // G
  logits = CAP * jnp.tanh(jnp.einsum('btnh,bsnh->bnts', q, k) * SCALE / CAP)
  i, j = np.arange(t)[:, None], np.arange(s)[None]
  vis = np.ones((B, 1, t, s), bool)
  if is_causal:
    vis &= j <= i
  if window is not None:
    vis &= (j >= i - window[0]) & (j <= i + window[1])
  if q_segment_ids is not None:
    vis &= (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]
  m = jnp.maximum(jnp.max(jnp.where(vis, logits, -jnp.inf), -1), sinks[:, None])  # [B, N, T]
  e = jnp.where(vis, jnp.exp(logits - m[..., None]), 0.0)
  denom = jnp.exp(sinks[:, None] - m) + e.sum(-1)  # [B, N, T]
  return jnp.einsum('bnts,bsnh->btnh', e / denom[..., None], v)


def _want(arrays, kw):
  """Output and the vjp of the cotangent w.r.t. q, k, v, sinks: the float64 reference."""
  with jax.enable_x64(True):
    q, k, v, ct = (jnp.asarray(a, jnp.float64) for a in arrays)
    out, vjp = jax.vjp(functools.partial(_reference, **kw), q, k, v,
                       jnp.asarray(SINKS, jnp.float64))
    return np.asarray(out), [np.asarray(g) for g in vjp(ct)]


def _got(fn, arrays):
  q, k, v, ct = (jnp.asarray(a) for a in arrays)

  @quick_jit
  def run(q, k, v, sinks, ct):
    out, vjp = jax.vjp(fn, q, k, v, sinks)
    return out, vjp(ct)

  return run(q, k, v, jnp.asarray(SINKS), ct)


def _kernel(impl, kw):
  """`fn(q, k, v, sinks)` of kernel `impl`, with tiles smaller than the lengths (so that the
  online softmax crosses tiles and skips some)."""
  seg = {name: None if kw.get(name) is None else jnp.asarray(kw[name])
         for name in ('q_segment_ids', 'kv_segment_ids')}
  common = dict(scale=SCALE, is_causal=kw['is_causal'], window=kw['window'], softcap=CAP, **seg)
  if impl == 'xla':
    return lambda q, k, v, sinks: attention_xla.attention(q, k, v, sinks=sinks, **common)
  if impl == 'blockwise':
    return lambda q, k, v, sinks: attention_blockwise.attention(
        q, k, v, sinks=sinks, block_q=8, block_k=8, **common)
  if impl == 'pallas':
    return lambda q, k, v, sinks: attention_pallas.gpu_attention(
        q, k, v, sinks=sinks, block_q=8, block_k=8, backend='interpret', **common)
  assert impl == 'pallas_tpu'
  return lambda q, k, v, sinks: attention_pallas_tpu.attention(
      q, k, v, sinks=sinks, interpret=True, **common)


def _check(got, want, tol):
  out, grads = got
  np.testing.assert_allclose(out, want[0], **tol)
  for name, g, w in zip(('dq', 'dk', 'dv', 'dsinks'), grads, want[1]):
    np.testing.assert_allclose(g, w, err_msg=name, **tol)


@pytest.mark.parametrize('case', list(CASES))
@pytest.mark.parametrize('impl', ['xla', 'blockwise', 'pallas'])
def test_kernel_matches_the_float64_reference(impl, case):
  arrays, kw = _case(case)
  want = _want(arrays, kw)
  got = _got(_kernel(impl, kw), arrays)
  _check(got, want, TOL)
  if 'segments' in case:
    np.testing.assert_array_equal(got[0][:, 18:], 0.0)  # rows with only the sink
    assert np.abs(np.asarray(got[0][:, :18])).sum() > 0


def test_the_mosaic_kernel_interpreted_matches_the_float64_reference():
  arrays, kw = _case('window_segments_mqa')
  _check(_got(_kernel('pallas_tpu', kw), arrays), _want(arrays, kw), TOL)


@pytest.mark.parametrize('case', ['causal_gqa', 'window_segments_mqa'])
def test_ring_on_two_sequence_devices_matches_the_float64_reference(case):
  arrays, kw = _case(case)
  segments = None
  if kw.get('q_segment_ids') is not None:
    segments = (jnp.asarray(kw['q_segment_ids']), jnp.asarray(kw['kv_segment_ids']))
  mesh = jax.make_mesh((1, 1, 1, 2), ('data', 'fsdp', 'tensor', 'sequence'),
                       devices=jax.devices()[:2])

  def fn(q, k, v, sinks):
    return attention.dot_product_attention(
        q, k, v, is_causal=kw['is_causal'], local_window_size=kw['window'], segment_ids=segments,
        implementation='ring', softcap=CAP, sinks=sinks)

  with jax.set_mesh(mesh):
    got = _got(fn, arrays)
  _check(got, _want(arrays, kw), TOL)


def test_the_pallas_entry_point_takes_them_through_dot_product_attention():
  """`dot_product_attention(implementation='pallas')`: the per-device wrapper and the platform
  dispatch pass the cap and the sinks on (the interpreted kernel on this CPU host)."""
  arrays, kw = _case('causal_gqa')

  def fn(q, k, v, sinks):
    return attention.dot_product_attention(q, k, v, is_causal=True, implementation='pallas',
                                           softcap=CAP, sinks=sinks)

  _check(_got(fn, arrays), _want(arrays, kw), TOL)


def _config(**model):
  config = validation.resolve(default.get_config())
  config.model.update(arch='decoder_only', num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                      d_ff=64, position='rope', attn_logit_softcap=0.5, attention_sinks=True)
  config.model.update(model)
  return config


def _with_sinks(model):
  """Distinct sink logits per layer and head (they start at 0)."""
  rng = np.random.default_rng(3)
  for _, node in nnx.iter_graph(model):
    if isinstance(node, attention.Attention) and node.sink_logits is not None:
      node.sink_logits.set_value(jnp.asarray(rng.standard_normal(node.sink_logits.shape),
                                             jnp.float32))
  return model


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_cached_decoding_equals_the_full_forward(arch):
  config = _config(arch=arch)
  validation.validate(config)
  model = _with_sinks(models.build(config.model, V, 16, rngs=nnx.Rngs(0)))
  if arch == 'decoder_only':
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
    batch = cache_batch = {'inputs': tokens}
  else:
    batch = enc_dec_batch()
    tokens = batch['tgt_inputs']
    cache_batch = {k: v for k, v in batch.items() if k.startswith('src_')}
  full, cached = full_and_cached_logits(model, batch, cache_batch, tokens)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


def test_both_change_the_output():
  """The cap bends scores of this size, and the sinks take mass: neither is a no-op."""
  config = _config()
  model = _with_sinks(models.build(config.model, V, 16, rngs=nnx.Rngs(0)))
  layers = [n for _, n in nnx.iter_graph(model) if isinstance(n, attention.Attention)]
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  outs = []
  for cap, sink in ((0.5, None), (0.0, None), (0.5, -30.0)):  # -30: no mass to the sinks
    for layer in layers:
      layer.softcap = cap
      if sink is not None:
        layer.sink_logits[...] = jnp.full((N,), sink)
    graphdef, state = nnx.split(model)
    outs.append(quick_jit(lambda s, x: nnx.merge(graphdef, s)({'inputs': x}))(state, tokens))
  assert np.abs(outs[1] - outs[0]).max() > 1e-3 and np.abs(outs[2] - outs[0]).max() > 1e-3


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_the_sinks_are_counted(arch):
  config = _config(arch=arch)
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, 16))
  formula = accounting.formula_params(config.model, V, 16)
  assert counted == formula
  plain = accounting.formula_params(_config(arch=arch, attention_sinks=False).model, V, 16)
  layers, cross = (4, 2) if arch == 'encoder_decoder' else (2, 0)  # two stacks of two layers
  assert formula['attention'] - plain['attention'] == layers * N  # a sink logit per head
  assert formula['cross_attention'] - plain['cross_attention'] == cross * N


REFUSALS = {
    (('attn_logit_softcap', -1.0),):
        'model.attn_logit_softcap=-1.0 must be a finite number >= 0 (0 = off)',
    (('attn_logit_softcap', float('inf')),):
        'model.attn_logit_softcap=inf must be a finite number >= 0 (0 = off)',
    (('attention_impl', 'cudnn'),):
        "model.attn_logit_softcap=0.5 is not taken by model.attention_impl='cudnn'; valid "
        'kernels: blockwise, pallas, ring, splash, xla',
    (('attention_impl', 'cudnn'), ('attn_logit_softcap', 0.0)):
        "model.attention_sinks=True is not taken by model.attention_impl='cudnn'; valid "
        'kernels: blockwise, pallas, ring, splash, xla',
    (('attention', 'linear'),):
        "model.attn_logit_softcap=0.5 is not taken by model.attention='linear'; valid values: "
        'dense, differential',
    (('attention', 'performer'), ('attn_logit_softcap', 0.0)):
        "model.attention_sinks=True is not taken by model.attention='performer'; valid values: "
        'dense, differential',
    (('arch', 'rnn_seq2seq'), ('attn_logit_softcap', 0.0)):
        "model.attention_sinks=True is not taken by model.arch='rnn_seq2seq' (no Transformer "
        'attention); valid value here: off',
}


@pytest.mark.parametrize('overrides', list(REFUSALS))
def test_refusals_are_one_line(overrides):
  config = _config(**dict(overrides))
  with pytest.raises(options.ConfigError) as e:
    validation.validate(config)
  assert str(e.value) == REFUSALS[overrides]


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['f32', 'bf16'])
def test_pallas_with_both_lowers_for_tpu_and_cuda(dtype):
  """Mosaic's and Triton's lowering rules accept the cap and the sinks in the forward, dQ and
  dK/dV kernels (tests/unit/test_pallas_lowering.py's check, every option on)."""
  t, h = 200, 64
  q = jax.ShapeDtypeStruct((1, t, N, h), dtype)
  kv = jax.ShapeDtypeStruct((1, t, 2, h), dtype)
  sinks = jax.ShapeDtypeStruct((N,), jnp.float32)

  def loss(q, k, v, sinks):
    out = attention.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(100, 0),
        alibi_slopes=jnp.linspace(0.5, 0.01, N),
        segment_ids=jnp.arange(t, dtype=jnp.int32)[None] // 70, implementation='pallas',
        softcap=50.0, sinks=sinks)
    return jnp.sum(out.astype(jnp.float32))

  traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(q, kv, kv, sinks)
  for platform, call in (('tpu', 'tpu_custom_call'), ('cuda', '__gpu$xla.gpu.triton')):
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert re.findall(r'custom_call @([\w$.]+)', text) == [call] * 3, platform


def test_the_attention_maps_are_the_forward_pass_weights():
  """`Attention.weights` (eval.py's maps) caps the logits and leaves the sinks' share out: the
  maps times v give the forward pass, and a row sums to 1 - p_sink < 1."""
  layer = _with_sinks(attention.Attention(16, 4, 2, softcap=0.5, sinks=True, rngs=nnx.Rngs(0)))
  x = jax.random.normal(jax.random.key(2), (2, 6, 16))
  maps = layer.weights(x, is_causal=True)  # [B, N, T, S]
  _, _, v = layer.project(x)
  want = attention_xla.combine(maps, v)  # [B, T, N, H]
  np.testing.assert_allclose(layer(x, is_causal=True), layer.out(want), atol=2e-6)
  assert np.all(np.asarray(maps.sum(-1)) < 1.0)
