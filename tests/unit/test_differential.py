"""Differential attention (Ye et al. 2024): the layer equals the paper's equations written out in
float64 (forward, and the gradient as float64 directional derivatives), with RoPE and GQA; every
kernel gives the same numbers; lambda_init follows the depth; cached decoding equals the full
forward pass; what it cannot do is refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import differential_attention
from layers import options
from layers import rope
from models import accounting
from tests.helpers import quick_jit
from tests.unit.test_decoding import full_and_cached_logits
from training import validation

D, T, B = 16, 6, 2
V = 23


def np_rope(x, base=10000.0):
  """RoPE of `x` `[B, T, n, d]` at positions 0..T-1, rotate-half pairs (x_i, x_{i + d/2})."""
  d = x.shape[-1]
  inv_freq = base ** (-np.arange(0, d, 2) / d)  # [d/2]
  angles = np.arange(x.shape[1])[:, None] * inv_freq  # [T, d/2]
  cos, sin = np.cos(angles)[None, :, None], np.sin(angles)[None, :, None]
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def np_softmax_causal(s):
  """Row softmax of `[..., T, T]` scores over the keys j <= i."""
  s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  e = np.exp(s - s.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def paper_reference(p, x, *, num_heads, num_kv_heads, layer, use_rope):
  """Ye et al. 2024, Sec. 2.1, in float64 for causal self-attention, head by head: for
  differential head i with Q1, Q2, K1, K2 of width d and V of width 2d,
  head_i = (softmax(Q1 K1ᵀ/√d) - λ softmax(Q2 K2ᵀ/√d)) V,
  λ = exp(λ_q1·λ_k1) - exp(λ_q2·λ_k2) + λ_init, λ_init = 0.8 - 0.6 exp(-0.3 (l - 1)),
  out = Concat((1 - λ_init) RMSNorm(head_i)) W_O.
  The layer's layout (its docstring): head i's Q1/Q2 are query projections i and N/2 + i, K1/K2
  and the two halves of V those of KV projections m and K/2 + m (m = i // (N/K)), and its 2d
  outputs meet output-projection rows i and N/2 + i."""
  n, k = num_heads, num_kv_heads
  h, g = n // 2, n // k
  q = np.einsum('btd,dnh->btnh', x, p['wq'])  # [B, T, N, d]
  kk = np.einsum('btd,dkh->btkh', x, p['wk'])  # [B, T, K, d]
  v = np.einsum('btd,dkh->btkh', x, p['wv'])  # [B, T, K, d]
  if use_rope:
    q, kk = np_rope(q), np_rope(kk)
  d = q.shape[-1]
  lam_init = 0.8 - 0.6 * np.exp(-0.3 * ((layer + 1) - 1))  # depth l = layer + 1
  lam = (np.exp(p['lq1'] @ p['lk1']) - np.exp(p['lq2'] @ p['lk2']) + lam_init)
  out = 0.0
  for i in range(h):
    m = i // g
    q1, q2, k1, k2 = q[:, :, i], q[:, :, h + i], kk[:, :, m], kk[:, :, k // 2 + m]  # [B, T, d]
    val = np.concatenate([v[:, :, m], v[:, :, k // 2 + m]], -1)  # [B, T, 2d]
    a1 = np_softmax_causal(np.einsum('btd,bsd->bts', q1, k1) / np.sqrt(d))
    a2 = np_softmax_causal(np.einsum('btd,bsd->bts', q2, k2) / np.sqrt(d))
    head = np.einsum('bts,bsd->btd', a1 - lam * a2, val)  # [B, T, 2d]
    head = head / np.sqrt(np.mean(head ** 2, -1, keepdims=True) + 1e-5) * p['g']
    w_o = np.concatenate([p['wo'][i], p['wo'][h + i]], 0)  # [2d, D]: head i's rows of W_O
    out = out + (1 - lam_init) * head @ w_o
  return out  # [B, T, D]


def params_of(layer):
  """The layer's parameters as float64 numpy, by the reference's names."""
  f = lambda a: np.asarray(a[...], np.float64)
  return {'wq': f(layer.query.kernel), 'wk': f(layer.key.kernel), 'wv': f(layer.value.kernel),
          'wo': f(layer.out.kernel), 'lq1': f(layer.lambda_q1), 'lk1': f(layer.lambda_k1),
          'lq2': f(layer.lambda_q2), 'lk2': f(layer.lambda_k2), 'g': f(layer.head_norm.scale)}


def make_layer(num_heads, num_kv_heads, layer, impl='xla'):
  return differential_attention.DifferentialAttention(
      D, num_heads, num_kv_heads, layer=layer, implementation=impl, rngs=nnx.Rngs(3))


@pytest.mark.parametrize('heads,use_rope', [((4, 4), False), ((4, 2), True), ((8, 2), True)])
def test_forward_and_gradient_equal_the_papers_equations(heads, use_rope):
  n, k = heads
  layer = make_layer(n, k, layer=2)
  position = rope.RoPE(D // n) if use_rope else None
  x = np.random.default_rng(0).normal(size=(B, T, D))
  graphdef, params = nnx.split(layer)

  w = np.random.default_rng(1).normal(size=(B, T, D))  # a random cotangent

  @quick_jit
  def forward_and_grad(params, x):
    f = lambda p, x: nnx.merge(graphdef, p)(x, is_causal=True, position=position)
    loss = lambda p, x: jnp.sum(f(p, x) * jnp.asarray(w, jnp.float32))
    return f(params, x), jax.grad(loss, argnums=(0, 1))(params, x)

  out, (g_params, g_x) = forward_and_grad(params, jnp.asarray(x, jnp.float32))
  ref = lambda p, x: paper_reference(p, x, num_heads=n, num_kv_heads=k, layer=2,
                                     use_rope=use_rope)
  p64 = params_of(layer)
  np.testing.assert_allclose(out, ref(p64, x), atol=1e-5, rtol=1e-5)
  # The gradient: <grad, u> for a random direction u of every parameter and the input, against
  # the float64 central difference of the reference along u.
  loss = lambda p, x: np.sum(ref(p, x) * w)
  rng = np.random.default_rng(2)
  u = {name: rng.normal(size=a.shape) for name, a in p64.items()}
  u_x = rng.normal(size=x.shape)
  grads = params_of(nnx.merge(graphdef, g_params))
  analytic = sum(np.sum(grads[name] * u[name]) for name in u) + np.sum(np.asarray(g_x) * u_x)
  eps = 1e-6
  shifted = lambda s: loss({name: a + s * u[name] for name, a in p64.items()}, x + s * u_x)
  numeric = (shifted(eps) - shifted(-eps)) / (2 * eps)
  np.testing.assert_allclose(analytic, numeric, rtol=1e-5)


def test_every_kernel_gives_the_xla_numbers():
  """xla, blockwise and Pallas (interpreted here): the padded maps, forward and gradient."""
  x = jax.random.normal(jax.random.key(0), (B, 8, D))
  graphdef, params = nnx.split(make_layer(4, 2, layer=1))
  outs = {}
  for impl in ('xla', 'blockwise', 'pallas'):
    layer = nnx.merge(graphdef, params)
    layer.implementation = impl
    g, p = nnx.split(layer)
    f = lambda p, x, g=g: jnp.sum(nnx.merge(g, p)(x, is_causal=True) ** 2)
    outs[impl] = quick_jit(jax.value_and_grad(f, argnums=(0, 1)))(p, x)
  for impl in ('blockwise', 'pallas'):
    for a, b in zip(jax.tree.leaves(outs[impl]), jax.tree.leaves(outs['xla'])):
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def model_config(**overrides):
  config = validation.resolve(default.get_config())
  config.model.update(arch='decoder_only', attention='differential', position='rope',
                      num_layers=3, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64)
  config.model.update(overrides)
  validation.validate(config)
  return config


def test_lambda_init_follows_the_depth():
  """λ_init = 0.8 - 0.6 exp(-0.3 (l - 1)) for layers l = 1, 2, 3: 0.2, 0.3555, 0.4707."""
  model = models.build(model_config().model, V, 16, rngs=nnx.Rngs(0))
  got = [b.self_attention.lambda_init for b in model.decoder.blocks]
  np.testing.assert_allclose(got, [0.2, 0.8 - 0.6 * np.exp(-0.3), 0.8 - 0.6 * np.exp(-0.6)],
                             rtol=1e-12)
  np.testing.assert_allclose(got, [0.2, 0.35550907, 0.47071302], atol=1e-8)
  # λ = exp(λ_q1·λ_k1) - exp(λ_q2·λ_k2) + λ_init, from the layer's own vectors in float64; the
  # exp terms matter at this precision (the same without them, or with one, is off by > 1e-5).
  lam = [float(b.self_attention.lam()) for b in model.decoder.blocks]
  dots = [[float(np.dot(np.asarray(getattr(b.self_attention, q)[...], np.float64),
                        np.asarray(getattr(b.self_attention, k)[...], np.float64)))
           for q, k in (('lambda_q1', 'lambda_k1'), ('lambda_q2', 'lambda_k2'))]
          for b in model.decoder.blocks]
  want = [np.exp(a) - np.exp(b) + init for (a, b), init in zip(dots, got)]
  np.testing.assert_allclose(lam, want, rtol=0, atol=1e-6)
  for broken in ([a - b + init for (a, b), init in zip(dots, got)],
                 [np.exp(a) - b + init for (a, b), init in zip(dots, got)]):
    assert np.max(np.abs(np.subtract(broken, want))) > 1e-5


@pytest.mark.parametrize('position,extra', [
    ('rope', {}), ('alibi', {}), ('rope', dict(attention_gate='headwise', qk_norm='rmsnorm')),
    ('rope', dict(attn_logit_softcap=2.0, attention_sinks=True))],
    ids=['rope', 'alibi', 'rope-gate-qknorm', 'rope-softcap-sinks'])
def test_cached_decoding_equals_the_full_forward(position, extra):
  """The dense cached step ends in the variant's `attend`; ALiBi's slopes (one per map) are
  recomputed against the cached slots there as for dense; the gate, QK-norm, the soft cap and the
  sinks (one per map) apply in both."""
  config = model_config(position=position, **extra)
  model = models.build(config.model, V, 16, rngs=nnx.Rngs(0))
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, 16))
  assert counted == accounting.formula_params(config.model, V, 16)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  full, cached = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)


def test_parameters_are_the_dense_projections_plus_six_head_dims():
  """4·D² (D 32) + the four λ vectors [H] and the head norm's scale [2H], H = 8."""
  config = model_config(num_kv_heads=4, num_layers=1)
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, 16))
  assert counted == accounting.formula_params(config.model, V, 16)
  assert counted['attention'] == 4 * 32 ** 2 + 6 * 8


def test_differential_maps_are_the_difference_of_the_softmax_maps():
  layer = make_layer(4, 2, layer=0)
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  probs = layer.weights(x, is_causal=True)  # [B, N, T, S]
  diff = layer.differential_weights(x, is_causal=True)  # [B, N/2, T, S]
  lam = float(layer.lam())
  np.testing.assert_allclose(diff, probs[:, :2] - lam * probs[:, 2:], atol=1e-6)
  np.testing.assert_allclose(diff.sum(-1), np.full(diff.shape[:-1], 1 - lam), atol=1e-6)


def refusal(**overrides):
  with pytest.raises(options.ConfigError) as e:
    model_config(**overrides)
  assert '\n' not in str(e.value)
  return str(e.value)


def test_what_it_cannot_do_is_refused_in_one_line():
  assert refusal(num_kv_heads=1) == (
      "model.num_kv_heads=1 must be even for model.attention='differential' (each differential "
      'head is a pair of softmax maps); valid values: 2, 4, 6, ...')
  assert refusal(num_heads=1, num_kv_heads=1).startswith('model.num_heads=1 must be even')
  assert refusal(scan_layers=True).startswith(
      "model.scan_layers=True is not valid for model.attention='differential'")


def test_score_stats_describe_the_softmax_maps():
  """has_scores: the diagnostics' entropy and sink share are those of the N maps `weights` gives,
  each a softmax over its own scaled q·k (max logit: the largest of those scores)."""
  layer = make_layer(4, 2, layer=0)
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  stats = layer.score_stats(x, is_causal=True)
  p = np.asarray(layer.weights(x, is_causal=True), np.float64)  # [B, N, T, S]
  entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)  # [B, N, T]
  np.testing.assert_allclose(stats['attn_entropy'], entropy.mean(), rtol=1e-5)
  np.testing.assert_allclose(stats['attn_sink_share'], p[..., 0].mean(), rtol=1e-5)
  q, k, _ = (np.asarray(a, np.float64) for a in layer.project(x))
  k = np.repeat(k, 2, axis=2)  # map n reads KV head n // (N/K)
  s = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(D // 4)
  np.testing.assert_allclose(stats['attn_max_logit'], s[..., np.tril(np.ones((T, T), bool))].max(),
                             rtol=1e-5)


def test_in_a_hybrid_stack_the_depth_is_the_layers_index_and_decoding_matches():
  """model.layer_pattern='dense,differential' over 4 layers: the differential layers 2 and 4 take
  λ_init of depths 2 and 4 (their index in the stack), and the cached steps equal the forward."""
  config = model_config(layer_pattern='dense,differential', num_layers=4)
  model = models.build(config.model, V, 16, rngs=nnx.Rngs(0))
  layers = [b.self_attention for b in model.decoder.blocks]
  assert [type(a).__name__ for a in layers] == ['Attention', 'DifferentialAttention'] * 2
  np.testing.assert_allclose([layers[1].lambda_init, layers[3].lambda_init],
                             [0.8 - 0.6 * np.exp(-0.3), 0.8 - 0.6 * np.exp(-0.9)], rtol=1e-12)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  full, cached = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(cached, full, atol=2e-5, rtol=2e-5)
