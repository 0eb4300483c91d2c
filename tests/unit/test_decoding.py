"""KV-cache decoding: cached steps equal the full forward; beam 1 is greedy; the cache size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from training import validation
from layers import attention
from layers import positions
from models import decoding
import models
from tests.helpers import jitted_forward, quick_jit

V = 23
# Every position method that exists now (rope, alibi, t5_bias join as they land in POSITIONS).
POSITION_NAMES = [p for p in ('sinusoidal', 'learned', 'nope', 'rope', 'alibi', 't5_bias')
                  if p in positions.POSITIONS]
HEADS = {'mha': (4, 4), 'gqa': (4, 2), 'mqa': (4, 1)}
# Every position with GQA (query heads sharing a cached head), and MHA/MQA with the methods whose
# numbers depend on the head layout (ALiBi: slopes per query head; RoPE: head_dim rotations).
CASES = ([(p, 'gqa') for p in POSITION_NAMES]
         + [(p, h) for h in ('mha', 'mqa')
            for p in ([q for q in ('rope', 'alibi') if q in POSITION_NAMES] or ['sinusoidal'])])


SPARSE = {'sliding_window': dict(window=3),
          'longformer': dict(window=2, global_tokens=(0, 5)),
          'bigbird': dict(bigbird_block=4, bigbird_random_blocks=1, global_tokens=(0, 5))}

KERNEL = {'performer': dict(performer_features=16), 'linear': {}}

PROMPTS = [[1, 7, 8, 3], [1, 9, 3], [1, 10, 11, 12, 13, 3]]


def model_config(arch, position='sinusoidal', num_heads=4, num_kv_heads=4, **overrides):
  config = validation.resolve(default.get_config())
  config.model.update(arch=arch, position=position, num_layers=2, d_model=32, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, d_ff=64, **overrides)
  validation.validate(config)
  return config.model


def build(arch, max_length=16, **kwargs):
  return models.build(model_config(arch, **kwargs), V, max_length, rngs=nnx.Rngs(0))


def full_and_cached_logits(model, batch, cache_batch, tokens):
  """(full forward `[B, T, V]`, the same fed one step at a time through the cache), one jit."""
  graphdef, params = nnx.split(model)

  @quick_jit
  def run(params, batch, cache_batch, tokens):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(cache_batch, tokens.shape[1] + 3)

    def step(cache, t):
      logits, cache = model.decode_step(cache, tokens[:, t], t)
      return cache, logits

    _, steps = jax.lax.scan(step, cache, jnp.arange(tokens.shape[1]))
    return model(batch), steps.swapaxes(0, 1)

  return run(params, batch, cache_batch, tokens)


@pytest.mark.parametrize('position,heads', CASES)
def test_decoder_only_cache_equals_full_forward(position, heads):
  n, k = HEADS[heads]
  model = build('decoder_only', position=position, num_heads=n, num_kv_heads=k)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
  full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('variant', list(SPARSE))
def test_sparse_decoder_cache_equals_full_forward(variant):
  """The cached step applies the variant's own pattern (window, global tokens, random blocks) at
  absolute positions; 21 tokens span several windows and BigBird blocks."""
  model = build('decoder_only', max_length=32, position='rope', num_heads=4, num_kv_heads=2,
                attention=variant, **SPARSE[variant])
  tokens = jax.random.randint(jax.random.key(1), (2, 21), 1, V)
  full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)
  # The pattern matters: dense attention over the same weights gives other logits.
  dense = nnx.merge(*nnx.split(model))
  for blk in dense.decoder.blocks:
    blk.self_attention.__class__ = attention.Attention
    blk.self_attention.local_window_size = None
  assert np.abs(dense({'inputs': tokens}) - full).max() > 1e-3


@pytest.mark.parametrize('variant', list(KERNEL))
def test_kernel_attention_recurrent_decode_equals_full_forward(variant):
  """Performer/linear decode with their prefix sums as the cache: constant size, same logits."""
  model = build('decoder_only', max_length=32, position='rope', num_heads=4, num_kv_heads=2,
                attention=variant, **KERNEL[variant])
  tokens = jax.random.randint(jax.random.key(1), (2, 21), 1, V)
  full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)
  sizes = {n: decoding.cache_size(model.init_cache({'inputs': tokens}, n)) for n in (8, 64)}
  assert sizes[8] == sizes[64], sizes


def enc_dec_batch(seed=2, src_len=7, tgt_len=6, pad_from=(7, 4)):
  src = jax.random.randint(jax.random.key(seed), (2, src_len), 6, V)
  seg = (jnp.arange(src_len)[None] < jnp.asarray(pad_from)[:, None]).astype(jnp.int32)  # [B, S]
  src = jnp.where(seg > 0, src, 0)
  tgt = jax.random.randint(jax.random.key(seed + 1), (2, tgt_len), 6, V)
  return {'src_inputs': src, 'src_segment_ids': seg,
          'src_positions': jnp.where(seg > 0, jnp.arange(src_len)[None], 0),
          'tgt_inputs': tgt, 'tgt_segment_ids': jnp.ones_like(tgt),
          'tgt_positions': jnp.broadcast_to(jnp.arange(tgt_len), tgt.shape)}


@pytest.mark.parametrize('position,heads', CASES)
def test_encoder_decoder_cache_equals_full_forward(position, heads):
  n, k = HEADS[heads]
  model = build('encoder_decoder', position=position, num_heads=n, num_kv_heads=k)
  batch = enc_dec_batch()
  src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
  full, step = full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder'])
def test_scanned_layers_cache_equals_full_forward(arch):
  """model.scan_layers: the full forward runs the stacked blocks in one scan (remat full), the
  cached steps run them layer by layer on slices of the stacked parameters; both agree."""
  model = build(arch, position='rope', num_heads=4, num_kv_heads=2, scan_layers=True,
                remat='full')
  assert model.decoder.blocks.ffn.wi.kernel.shape[0] == 2  # stacked: [L, D, F]
  if arch == 'decoder_only':
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
    full, step = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  else:
    batch = enc_dec_batch()
    src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
    full, step = full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('cell,attention', [('lstm', 'bahdanau'), ('gru', 'luong'),
                                            ('lstm', 'none')])
def test_rnn_step_equals_teacher_forced_pass(cell, attention):
  model = build('rnn_seq2seq', rnn_cell=cell, rnn_attention=attention)
  batch = enc_dec_batch()
  src = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
  full, step = full_and_cached_logits(model, batch, src, batch['tgt_inputs'])
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder', 'rnn_seq2seq'])
def test_softcapped_cache_equals_full_forward(arch):
  """model.final_logit_softcap = c: the cached step's logits are capped as the full forward's,
  both c·tanh(x / c) of the uncapped model's (same parameters, seed 0) and inside (-c, c);
  c = 0.5 bends most of an untrained Transformer's logits, 0.02 the RNN's (std about 0.03)."""
  cap = 0.02 if arch == 'rnn_seq2seq' else 0.5
  model = build(arch, final_logit_softcap=cap)
  if arch == 'decoder_only':
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, V)
    batch = cache_batch = {'inputs': tokens}
  else:
    batch = enc_dec_batch()
    cache_batch = {key: batch[key] for key in ('src_inputs', 'src_segment_ids', 'src_positions')}
    tokens = batch['tgt_inputs']
  full, step = full_and_cached_logits(model, batch, cache_batch, tokens)
  np.testing.assert_allclose(step, full, atol=2e-5, rtol=2e-5)
  raw = np.asarray(jitted_forward(build(arch))(batch), np.float64)  # [B, T, V] uncapped
  assert np.max(np.abs(raw)) > 2 * cap
  np.testing.assert_allclose(step, cap * np.tanh(raw / cap), atol=2e-5 * cap)
  assert np.max(np.abs(step)) < cap


def test_cross_attention_ignores_source_padding():
  model = jitted_forward(build('encoder_decoder'))
  batch = enc_dec_batch(pad_from=(7, 4))
  other = dict(batch, src_inputs=batch['src_inputs'].at[1, 4:].set(jnp.asarray([9, 10, 11])))
  a, b = model(batch), model(other)
  np.testing.assert_array_equal(a, b)
  # The check has teeth: changing a real source token changes the output.
  changed = dict(batch, src_inputs=batch['src_inputs'].at[1, 2].add(1))
  assert np.abs(model(changed)[1] - a[1]).max() > 1e-4


@pytest.mark.parametrize('heads', list(HEADS))
def test_kv_cache_holds_2_layers_kv_heads_head_dim_length(heads):
  n, k = HEADS[heads]
  model = build('decoder_only', num_heads=n, num_kv_heads=k)
  cache = model.init_cache({'inputs': jnp.zeros((1, 16), jnp.int32)}, 16)
  layers, head_dim, length = 2, 32 // n, 16
  assert decoding.cache_size(cache) == 2 * layers * k * head_dim * length
  assert cache['self'][0]['k'].shape == (1, length, k, head_dim)


def test_textbook_kv_cache_example():
  """2 (K and V) x 32 layers x 32 heads x head_dim 64 x length 2048 = 268,435,456 elements; GQA-8 a
  quarter, MQA a 32nd (the cache of one layer's attention, shapes only, times 32 layers)."""
  for k, want in ((32, 268_435_456), (8, 268_435_456 // 4), (1, 268_435_456 // 32)):
    layer = nnx.eval_shape(lambda k=k: attention.Attention(2048, 32, k, rngs=nnx.Rngs(0)))
    shapes = jax.eval_shape(lambda layer=layer: layer.init_cache(1, 2048))
    assert 32 * sum(np.prod(s.shape) for s in jax.tree.leaves(shapes)) == want


def test_cached_greedy_equals_full_forward_greedy():
  model = build('decoder_only', max_length=24)
  kwargs = dict(length=20, max_new=8, eos_id=2, batch_size=2)
  assert (decoding.greedy_translate(model, PROMPTS, **kwargs)
          == decoding.greedy_translate(model, PROMPTS, use_cache=False, **kwargs))


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_decoder', 'rnn_seq2seq'])
def test_beam_size_one_equals_greedy(arch):
  model = build(arch, max_length=24)
  if arch == 'decoder_only':
    kwargs = dict(prompts=PROMPTS)
  else:
    kwargs = dict(prompts=[[1]] * 3, sources=[p[1:-1] + [2] for p in PROMPTS])
  greedy = decoding.generate(model, max_new=8, eos_id=2, **kwargs)
  beam = decoding.generate(model, max_new=8, eos_id=2, method='beam', num_beams=1,
                           length_penalty=0.6, **kwargs)
  assert greedy == beam
  assert any(len(g) > 0 for g in greedy)


def test_beam_search_finds_a_higher_scoring_sequence_than_greedy():
  """With length_penalty 0 beams rank by log P(y|x): the best of 4 beams is never below greedy."""
  model = build('decoder_only', max_length=24)
  graphdef, params = nnx.split(model)

  def logprob(prompt, gen):
    seq = prompt + gen + [2]
    logits = model({'inputs': jnp.asarray([seq])})[0]
    lp = jax.nn.log_softmax(logits)
    return float(sum(lp[i - 1, seq[i]] for i in range(len(prompt), len(seq))))

  del graphdef, params
  greedy = decoding.generate(model, PROMPTS, max_new=6, eos_id=2)
  beam = decoding.generate(model, PROMPTS, max_new=6, eos_id=2, method='beam', num_beams=4,
                           length_penalty=0.0)
  for p, g, b in zip(PROMPTS, greedy, beam):
    if len(g) < 6 and len(b) < 6:  # both finished with eos: comparable complete sequences
      assert logprob(p, b) >= logprob(p, g) - 1e-4


def test_sampling_temperature_zero_is_greedy_and_top_k_1_too():
  model = build('decoder_only', max_length=24)
  greedy = decoding.generate(model, PROMPTS, max_new=6, eos_id=2)
  assert decoding.generate(model, PROMPTS, max_new=6, eos_id=2, method='sample',
                           temperature=0.0) == greedy
  assert decoding.generate(model, PROMPTS, max_new=6, eos_id=2, method='sample', top_k=1,
                           seed=3) == greedy


def test_sampling_in_parts_cut_at_batches_equals_sampling_the_whole():
  """eval.py's processes each sample a part of the sentences: parts cut at multiples of the batch,
  given their `row_offset`, draw what one process drawing the whole list draws."""
  model = build('decoder_only', max_length=24)
  prompts = [p for _ in range(3) for p in PROMPTS]  # 3 batches of len(PROMPTS) rows
  kwargs = dict(max_new=6, eos_id=2, method='sample', seed=5, batch_size=len(PROMPTS))
  whole = decoding.generate(model, prompts, **kwargs)
  cut = len(PROMPTS)
  parts = (decoding.generate(model, prompts[:cut], **kwargs)
           + decoding.generate(model, prompts[cut:], row_offset=cut, **kwargs))
  assert parts == whole
  assert decoding.generate(model, prompts[cut:], **kwargs) != whole[cut:]  # the offset matters


def test_top_k_and_top_p_keep_only_the_likely_tokens():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 2000)
  draw = lambda **kw: np.asarray(jax.vmap(  # noqa: E731
      lambda k: decoding.sample_logits(k, logits, **kw)[0])(keys))
  assert set(draw(top_k=2)) == {0, 1}
  assert set(draw(top_p=0.7)) == {0, 1}  # 0.5 < 0.7 <= 0.8
  assert set(draw(top_p=0.5)) == {0}
  freq = np.bincount(draw(), minlength=4) / len(keys)
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.04)
