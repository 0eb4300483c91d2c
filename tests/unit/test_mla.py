"""Multi-head latent attention (model.attention='mla', DeepSeek-V2 eqs. 9-19): the layer against a
float64 reference of the equations, forward and gradient; the absorbed cached step against the
unabsorbed form over the same cache; cached decoding against the full forward pass; the cache's
shapes; the parameter and cache accounting; and the refusals, one line each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import attention
from layers import attention_variants
from layers import mla_attention
from layers import options
from layers import rope
from models import accounting
from models import decoding
from tests.helpers import quick_jit
from tests.unit import test_decoding
from tools import accounting as accounting_tool
from training import validation

B, T, D, N = 2, 9, 16, 4
H = D // N
BASE = 10000.0
# (kv heads K, query latent d_c', rotary width d_h^R, causal, packed segments)
CASES = {
    'mha_rope_causal': (N, 0, 2, True, False),
    'gqa_qlatent_rope_segments': (2, 6, 4, True, True),
    'mqa_qlatent_encoder_segments': (1, 5, 2, False, True),
    'nope_encoder': (N, 0, 0, False, False),
}


def build(kv_heads=N, q_rank=0, rope_dim=2, kv_rank=6, seed=0, **kwargs):
  return mla_attention.MultiHeadLatentAttention(D, N, kv_heads, kv_rank=kv_rank, q_rank=q_rank,
                                                rope_dim=rope_dim, rngs=nnx.Rngs(seed), **kwargs)


def inputs(seed=1, segments=False):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
  if not segments:
    return x, jnp.broadcast_to(jnp.arange(T), (B, T)), None
  # Row 0: segments of 4 and 5 tokens (positions restart); row 1: 7 tokens, then padding.
  seg = np.array([[1] * 4 + [2] * 5, [1] * 7 + [0] * 2])
  pos = np.array([list(range(4)) + list(range(5)), list(range(9))])
  return x, jnp.asarray(pos), jnp.asarray(seg)


def params64(layer):
  """The layer's parameters as float64 numpy arrays, by their attribute paths."""
  return {'/'.join(map(str, path)): np.asarray(v.get_value(), np.float64)
          for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}


def reference(p, x, pos, seg, *, kv_heads, q_rank, rope_dim, causal):
  """DeepSeek-V2 eqs. 9-19 written out in jnp (float64 under `jax.enable_x64`): `[B, T, D]`."""
  def rms(a, scale):  # RMSNorm, eps 1e-6, as DeepSeek-V2 on c_KV and c_Q
    return a / jnp.sqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-6) * scale

  def rot(a):  # RoPE over the whole width R, rotate-half pairs (i, i + R/2)
    r = a.shape[-1]
    theta = BASE ** (-np.arange(0, r, 2) / r)  # [R/2]
    ang = pos[:, :, None, None] * theta  # [B, T, 1, R/2]
    a1, a2 = a[..., :r // 2], a[..., r // 2:]
    return jnp.concatenate([a1 * jnp.cos(ang) - a2 * jnp.sin(ang),
                            a2 * jnp.cos(ang) + a1 * jnp.sin(ang)], -1)

  c_kv = rms(x @ p['kv_down/kernel'], p['kv_norm/scale'])  # [B, T, d_c]  (9)
  k_c = jnp.einsum('BSC,CKH->BSKH', c_kv, p['key_up/kernel'])  # (10)
  v = jnp.einsum('BSC,CKH->BSKH', c_kv, p['value_up/kernel'])  # (11)
  c_q = rms(x @ p['q_down/kernel'], p['q_norm/scale']) if q_rank else x  # (12)
  q_c = jnp.einsum('BTE,ENH->BTNH', c_q, p['query/kernel'])  # (13)
  q, k = q_c, k_c
  if rope_dim:
    q_r = rot(jnp.einsum('BTE,ENR->BTNR', c_q, p['query_rope/kernel']))  # (14)
    k_r = rot((x @ p['key_rope/kernel'])[:, :, None])  # [B, T, 1, R]  (16)
    q = jnp.concatenate([q_c, q_r], -1)  # (15)
    k = jnp.concatenate([k_c, jnp.broadcast_to(k_r, k_c.shape[:3] + (rope_dim,))], -1)  # (17)
  g = N // kv_heads
  k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # [B, S, N, .]
  logits = jnp.einsum('BTNE,BSNE->BNTS', q, k) / np.sqrt(H + rope_dim)
  vis = np.ones((B, 1, T, T), bool)
  if causal:
    vis = vis & np.tril(np.ones((T, T), bool))
  if seg is not None:
    vis = vis & (seg[:, None, :, None] == seg[:, None, None, :])
  probs = jax.nn.softmax(jnp.where(vis, logits, -jnp.inf), -1)  # (18)
  o = jnp.einsum('BNTS,BSNH->BTNH', probs, v)
  return jnp.einsum('BTNH,NHD->BTD', o, p['out/kernel'])  # (19)


@pytest.mark.parametrize('case', list(CASES))
def test_forward_and_gradient_match_a_float64_reference(case):
  kv_heads, q_rank, rope_dim, causal, segments = CASES[case]
  layer = build(kv_heads, q_rank, rope_dim)
  x, pos, seg = inputs(segments=segments)
  position = rope.RoPE(H) if rope_dim else None
  ct = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
  graphdef, state = nnx.split(layer)

  @quick_jit
  def got(state, x):
    def loss(state, x):
      y = nnx.merge(graphdef, state)(x, segment_ids=seg, is_causal=causal, positions=pos,
                                     position=position)
      return jnp.sum(y * ct), y
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)

  (_, y), (g_state, g_x) = got(state, x)
  kw = dict(kv_heads=kv_heads, q_rank=q_rank, rope_dim=rope_dim, causal=causal)
  with jax.enable_x64(True):
    p = {k: jnp.asarray(v) for k, v in params64(layer).items()}
    x64, ct64 = jnp.asarray(x, jnp.float64), jnp.asarray(ct, jnp.float64)
    seg64 = None if seg is None else np.asarray(seg)
    want_y = reference(p, x64, np.asarray(pos), seg64, **kw)
    want_gp, want_gx = jax.grad(lambda p, x: jnp.sum(
        reference(p, x, np.asarray(pos), seg64, **kw) * ct64), argnums=(0, 1))(p, x64)
  np.testing.assert_allclose(y, want_y, rtol=0, atol=2e-6)
  np.testing.assert_allclose(g_x, want_gx, rtol=0, atol=1e-5)
  got_gp = {'/'.join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(g_state)}
  assert sorted(got_gp) == sorted(want_gp)
  for name, want in want_gp.items():
    want = np.asarray(want)
    scale = max(1.0, float(np.max(np.abs(want))))
    np.testing.assert_allclose(got_gp[name], want, rtol=0, atol=1e-5 * scale, err_msg=name)


def test_kernels_without_value_width_pad_v_and_agree_with_xla():
  """blockwise and pallas take v as wide as q and k: the layer pads v with zeros and cuts the
  output back; xla takes v of width H beside q, k of H + d_h^R as they are."""
  assert attention.KERNELS['xla'].value_width and not attention.KERNELS['blockwise'].value_width
  x, pos, seg = inputs(segments=True)
  outs = {}
  for impl in ('xla', 'blockwise', 'pallas'):
    layer = build(2, 6, 4, implementation=impl)
    outs[impl] = layer(x, segment_ids=seg, is_causal=True, positions=pos, position=rope.RoPE(H))
  for impl in ('blockwise', 'pallas'):
    np.testing.assert_allclose(outs[impl], outs['xla'], rtol=0, atol=2e-6)


def fill_cache(layer, x, position):
  """Decodes `x` `[B, T, D]` token by token: (`[B, T, D]` outputs, the final cache)."""
  cache = layer.init_cache(B, x.shape[1])
  outs = []
  for i in range(x.shape[1]):
    out, cache = layer.decode(x[:, i:i + 1], cache, jnp.full((B,), i), position=position)
    outs.append(out)
  return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize('kv_heads,q_rank,rope_dim', [(N, 0, 2), (2, 6, 4), (1, 5, 0)])
def test_cached_decode_equals_the_full_forward(kv_heads, q_rank, rope_dim):
  layer = build(kv_heads, q_rank, rope_dim)
  x, pos, _ = inputs()
  position = rope.RoPE(H) if rope_dim else None
  full = layer(x, is_causal=True, positions=pos, position=position)  # [B, T, D]
  stepped, cache = fill_cache(layer, x, position)
  np.testing.assert_allclose(stepped, full, rtol=0, atol=1e-5)
  # The cache holds the latent and the shared rotary key only: nothing per head.
  assert jax.tree.map(jnp.shape, cache) == {'c_kv': (B, T, 6), 'k_rope': (B, T, rope_dim)}


def test_absorbed_step_equals_the_unabsorbed_form():
  """W_UK folded into the query and W_UV into the output give the attention of the up-projected
  cache (k = [W_UK c_KV; k^R], v = W_UV c_KV) per head."""
  layer = build(2, 6, 4)
  position = rope.RoPE(H)
  x, _, _ = inputs()
  _, cache = fill_cache(layer, x[:, :-1], position)  # slots 0..T-2 filled
  cache = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, 1), (0, 0))), cache)
  index = T - 1
  got, new_cache = layer.decode(x[:, -1:], cache, index, position=position)  # [B, 1, D]
  q_c, q_r = layer.queries(x[:, -1:], jnp.full((B, 1), index), position)  # [B, 1, N, .]
  c_kv, k_r = new_cache['c_kv'], new_cache['k_rope']  # [B, T, d_c], [B, T, R]
  k_c = layer.key_up(c_kv)  # [B, T, K, H]
  k = jnp.concatenate([k_c, jnp.broadcast_to(k_r[:, :, None], k_c.shape[:3] + (4,))], -1)
  want = layer.out(attention.dot_product_attention(
      jnp.concatenate([q_c, q_r], -1), k, layer.value_up(c_kv), is_causal=False))  # [B, 1, D]
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def config_of(**model):
  config = default.get_config('quick')
  config.model.update({'attention': 'mla', 'position': 'rope', 'num_layers': 2, 'd_model': D,
                       'num_heads': N, 'd_ff': 32, **model})
  config.data.max_length = 16
  return validation.resolve(config)


def test_a_decoder_model_decodes_with_the_latent_cache():
  """models.build's decoder: the per-layer caches are latents, their size is the accounting's
  closed form, and greedy decoding's cached logits equal the full forward pass's."""
  config = config_of(mla_q_rank=6)
  validation.validate(config)
  model = models.build(config.model, 23, 16, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(3), (B, 8), 5, 23)
  cache = model.init_cache({'inputs': tokens}, 8)
  h, r = H, mla_attention.rope_dim(config.model)
  assert r == 2  # H/2 = 2 under rope (d_h^R = d_h / 2 as DeepSeek-V2)
  assert decoding.cache_size(cache) == B * 8 * accounting.kv_cache_per_token(config.model)
  assert accounting.kv_cache_per_token(config.model) == 2 * (32 + r)
  logits = []
  for i in range(8):
    step, cache = model.decode_step(cache, tokens[:, i], i)
    logits.append(step)
  full = model({'inputs': tokens})  # [B, T, V]
  np.testing.assert_allclose(jnp.stack(logits, 1), full, rtol=0, atol=2e-5)
  assert h == 4


def test_parameters_are_counted_in_closed_form():
  for model in ({}, {'mla_q_rank': 6}, {'num_kv_heads': 2, 'mla_rope_dim': 4},
                {'position': 'nope', 'head_dim': 6}):
    cfg = config_of(**model).model
    layer = attention_variants.VARIANTS['mla'].from_config(cfg, rngs=nnx.Rngs(0))
    counted = sum(np.size(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(layer,
                                                                               nnx.Param)))
    assert counted == mla_attention.MultiHeadLatentAttention.param_count(cfg), model


def test_the_cache_per_token_is_below_mha_and_reported():
  """d_c + d_h^R against 2·K·H: at D 512, N 8 (H 64) MLA's defaults cache 32 + 32 = 64 elements a
  token and layer, MHA's 1,024, GQA-2's 256, MQA's 128."""
  cfg = config_of(d_model=512, num_heads=8).model
  mla = attention_variants.VARIANTS['mla'].cache_per_token(cfg)
  dense = {k: attention.Attention.cache_per_token(config_of(d_model=512, num_heads=8,
                                                            num_kv_heads=k).model)
           for k in (8, 2, 1)}
  assert (mla, dense) == (64, {8: 1024, 2: 256, 1: 128})
  assert mla < dense[8]
  config = config_of(d_model=512, num_heads=8)
  validation.validate(config)
  text = accounting_tool.report(config, 23)
  assert '| this config (attention=mla, K=8) | d_c + d_h^R | 64 |' in text
  assert '| attention | 720,928 | 2 | 1,441,856 | D·d_c + d_c + 2·d_c·K·H' in text
  assert '| MHA (K = N = 8) | 2·N·H | 1,024 |' in text and '| MQA (K = 1) | 2·H | 128 |' in text


@pytest.mark.parametrize('model,message', [
    ({'mla_kv_rank': 0}, r'model.mla_kv_rank=0 must be a positive integer$'),
    ({'mla_q_rank': -1}, r'model.mla_q_rank=-1 must be an integer >= 0$'),
    ({'mla_rope_dim': 3}, r'model.mla_rope_dim=3 must be even'),
    ({'position': 'alibi'}, r"model.position='alibi' adds a term to the scores, .* valid values: "
                            r'learned, nope, rope, sinusoidal$'),
    ({'position': 'xpos'}, r"model.position='xpos' rotates q and k at their head width only"),
    ({'position': 'sinusoidal', 'mla_rope_dim': 4},
     r"model.mla_rope_dim=4 is a rotary part, which model.position='sinusoidal' does not rotate; "
     r'valid: model.mla_rope_dim=0, or model.position in: rope$'),
    ({'rope_fraction': 0.5}, r"model.rope_fraction=0.5 is not read by model.attention='mla'"),
    ({'use_bias': True}, r"model.use_bias=True: model.attention='mla' has no projection biases"),
])
def test_bad_values_are_refused_in_one_line(model, message):
  with pytest.raises(options.ConfigError, match=f'^{message}') as e:
    validation.validate(config_of(**model))
  assert '\n' not in str(e.value)


def test_score_stats_are_those_of_the_full_scores():
  """has_scores: the diagnostics' max logit is the max of the q·k / sqrt(H + d_h^R) the forward
  pass takes its softmax of."""
  layer = build(2, 6, 4)
  x, pos, _ = inputs()
  stats = layer.score_stats(x, positions=pos, is_causal=True, position=rope.RoPE(H))
  q, k, _, _ = layer.prepare(x, positions=pos, position=rope.RoPE(H))
  logits = np.einsum('BTNE,BSNE->BNTS', np.asarray(q, np.float64),
                     np.repeat(np.asarray(k, np.float64), 2, axis=2)) / np.sqrt(H + 4)
  logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
  np.testing.assert_allclose(stats['attn_max_logit'], logits.max(), rtol=1e-5)


@pytest.mark.parametrize('arch,overrides', [
    ('encoder_decoder', {}),
    ('decoder_only', {'scan_layers': True, 'remat': 'full'}),
], ids=['encoder_decoder', 'decoder_only-scanned'])
def test_model_cache_equals_full_forward(arch, overrides):
  """An encoder-decoder (MLA in the bidirectional encoder over padded sources, and in the cached
  decoder) and a scanned decoder (`scannable`): the cached logits are the full forward's."""
  model = test_decoding.build(arch, position='rope', num_heads=4, num_kv_heads=2, attention='mla',
                              mla_q_rank=12, **overrides)
  if arch == 'decoder_only':
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, 23)
    batch = cache_batch = {'inputs': tokens}
  else:
    batch = test_decoding.enc_dec_batch()
    cache_batch = {k: batch[k] for k in ('src_inputs', 'src_segment_ids', 'src_positions')}
    tokens = batch['tgt_inputs']
  full, step = test_decoding.full_and_cached_logits(model, batch, cache_batch, tokens)
  np.testing.assert_allclose(step, full, rtol=0, atol=2e-5)
