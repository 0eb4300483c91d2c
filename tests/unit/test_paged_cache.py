"""Paged KV cache: paged decoding equals contiguous decoding; the page allocator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from layers import attention
from layers import attention_variants
from layers import masks
from layers import paged_attention
from layers import positions
from models import decoding
from tests.unit.test_decoding import PROMPTS, V, build
from tests.helpers import quick_jit

PAGE = 4



def contiguous_logits(model, tokens):
  """`[B, T, V]` logits of `tokens` `[B, T]` fed one step at a time through the contiguous cache."""
  graphdef, params = nnx.split(model)

  @quick_jit
  def run(params, tokens):
    model = nnx.merge(graphdef, params)
    cache = model.init_cache({'inputs': tokens}, tokens.shape[1])

    def step(cache, t):
      logits, cache = model.decode_step(cache, tokens[:, t], t)
      return cache, logits

    return jax.lax.scan(step, cache, jnp.arange(tokens.shape[1]))[1].swapaxes(0, 1)

  return run(params, tokens)


@pytest.mark.parametrize('position,variant', [('rope', 'dense'), ('alibi', 'dense'),
                                              ('rope', 'differential')])
def test_paged_decode_equals_contiguous_decode(position, variant):
  """Three rows of 5, 11 and 9 tokens (crossing page boundaries at 4 and 8) share a shuffled pool of
  6 pages (+ the null page), fewer than the 9 that B x S_max would reserve: row 0's pages are freed
  when it ends and handed to the longer rows, whose stale contents must stay masked. (Differential
  attention reads the dense cache through its own `attend`.)"""
  model = build('decoder_only', position=position, num_heads=4, num_kv_heads=2, attention=variant)
  lengths = np.asarray([5, 11, 9])
  b, t_max = len(lengths), int(lengths.max())
  tokens = jax.random.randint(jax.random.key(1), (b, t_max), 1, V)
  want = np.asarray(contiguous_logits(model, tokens))  # [B, T, V]

  num_pages = 7
  max_pages = paged_attention.pages_for(t_max, PAGE)  # 3
  alloc = paged_attention.PageAllocator(num_pages, PAGE, b, max_pages, seed=3)
  cache = model.init_cache({'inputs': tokens}, t_max, page_size=PAGE, num_pages=num_pages)
  assert cache['self'][0]['k_pages'].shape == (num_pages, PAGE, 2, 8)
  assert cache['block_table'].shape == (b, max_pages)
  graphdef, params = nnx.split(model)
  step = quick_jit(lambda params, cache, tok, t: nnx.merge(graphdef, params).decode_step(
      cache, tok, t))
  got = np.zeros_like(want)
  tables, freed = {}, []
  for t in range(t_max):
    for row in range(b):
      if t < lengths[row]:
        alloc.reserve(row, t + 1)
      elif alloc.num_allocated[row]:
        freed += list(alloc.block_table[row, :alloc.num_allocated[row]])
        alloc.free(row)
    cache['block_table'] = jnp.asarray(alloc.block_table)
    logits, cache = step(params, cache, tokens[:, t], t)
    got[:, t] = np.asarray(logits)
    for row in np.flatnonzero(alloc.num_allocated):
      tables[row] = alloc.block_table[row, :alloc.num_allocated[row]].copy()  # its latest pages
  for row, n in enumerate(lengths):
    np.testing.assert_allclose(got[row, :n], want[row, :n], atol=1e-5, rtol=1e-5)
  # The block table was followed: physical pages are out of order, and row 0's pages were reused.
  assert any(np.any(np.diff(tables[row]) != 1) for row in (1, 2)), tables
  assert set(freed) & (set(tables[1]) | set(tables[2])), (freed, tables)


def scans(layer, runs, x):
  """For each (visible rule, position, cache) of `runs`: (`[B, T, D]` outputs of `cached_step`
  fed `x` `[B, T, D]` one position at a time, the final cache); one jit for all."""
  graphdef, params = nnx.split(layer)
  rules = [(rule, position) for rule, position, _ in runs]

  @quick_jit
  def run(params, caches):
    layer = nnx.merge(graphdef, params)
    results = []
    for (rule, position), cache in zip(rules, caches):
      def step(cache, t, rule=rule, position=position):
        xt = jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)  # [B, 1, D]
        out, cache = layer.cached_step(xt, cache, t, position=position, visible=rule)
        return cache, out[:, 0]

      cache, outs = jax.lax.scan(step, cache, jnp.arange(x.shape[1]))
      results.append((outs.swapaxes(0, 1), cache))
    return results

  return run(params, [cache for _, _, cache in runs])


def test_paged_pool_layout_and_window_and_sparse_rules():
  """Layer level, GQA (4 query, 2 kv heads): `cached_step` under a sliding window (with and without
  a T5 bias, recomputed over the logical slots) and a Longformer pattern gives the contiguous
  outputs through the paged storage, with pages assigned in a shuffled order; after 10 steps the
  pool holds each row's key j at (table[r, j // page], j % page), exactly the contiguous slot j."""
  b, steps, m = 2, 10, 3  # 10 positions on 3 pages of 4 per row
  x = jax.random.normal(jax.random.key(0), (b, steps, 32))  # [B, T, D]
  # Every page allocated, in a shuffled order (page 0 is the null page).
  table = np.random.default_rng(0).permutation(np.arange(1, 1 + b * m)).reshape(b, m)  # [B, M]
  assert np.any(np.diff(table, axis=1) != 1)
  with nnx.use_eager_sharding(False):  # as models.build: parameters only carry axis names
    window = attention.Attention(32, 4, 2, local_window_size=(2, 0), rngs=nnx.Rngs(0))
    longformer = attention_variants.VARIANTS['longformer'](
        32, 4, 2, window=1, global_tokens=(0, 5), rngs=nnx.Rngs(0))
    t5 = positions.T5Bias(4, 32, num_buckets=8, max_distance=16, rngs=nnx.Rngs(1))
  long_pattern = longformer.pattern(m * PAGE, True)
  causal = lambda q, k: masks.visible(q, k, is_causal=True)  # noqa: E731
  in_window = lambda q, k: masks.visible(q, k, is_causal=True, window=(2, 0))  # noqa: E731
  cases = {
      'window': (window, in_window, None),
      'window_t5': (window, in_window, t5),
      'longformer': (longformer, lambda q, k: masks.sparse_visible(q, k, long_pattern,
                                                                   is_causal=True), None),
  }
  for name, (layer, rule, position) in cases.items():
    paged = {**paged_attention.init_pages(1 + b * m, PAGE, 2, 8),
             'block_table': jnp.asarray(table, jnp.int32)}
    (want, contiguous), (got, paged), (dense, _) = scans(layer, [
        (rule, position, layer.init_cache(b, m * PAGE)), (rule, position, paged),
        (causal, position, layer.init_cache(b, m * PAGE))], x)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)
    pages = np.asarray(paged['k_pages'])  # [P, page, K, H]
    for r in range(b):
      for j in range(steps):
        np.testing.assert_array_equal(pages[table[r, j // PAGE], j % PAGE],
                                      np.asarray(contiguous['k'][r, j]))
    # The rule matters: plain causal attention over the same cache gives other outputs.
    assert np.abs(np.asarray(dense) - np.asarray(want)).max() > 1e-3, name


def test_paged_greedy_equals_contiguous_greedy():
  model = build('decoder_only', position='rope', num_heads=4, num_kv_heads=2)  # buffer 6 + 8
  kwargs = dict(max_new=8, eos_id=2, batch_size=2)
  want = decoding.generate(model, PROMPTS, **kwargs)
  assert decoding.generate(model, PROMPTS, paged=True, page_size=PAGE, **kwargs) == want
  assert any(len(g) > 0 for g in want)
  with pytest.raises(RuntimeError, match='KV page pool exhausted'):
    decoding.generate(model, PROMPTS, paged=True, page_size=PAGE, num_pages=2, **kwargs)
  with pytest.raises(ValueError, match='paged=True supports'):
    decoding.generate(model, PROMPTS, paged=True, method='beam', **kwargs)


def test_allocator_reuses_freed_pages_and_says_when_the_pool_is_exhausted():
  alloc = paged_attention.PageAllocator(5, PAGE, batch_size=2, max_pages_per_seq=3)
  alloc.reserve(0, 9)  # 3 pages
  alloc.reserve(1, 3)  # 1 page
  alloc.reserve(1, 4)  # still 1 page: a no-op
  assert alloc.num_free == 0 and alloc.pages_in_use == 4
  assert paged_attention.NULL_PAGE not in alloc.block_table[0]
  row0 = set(alloc.block_table[0].tolist())
  with pytest.raises(RuntimeError) as err:
    alloc.reserve(1, 5)
  message = str(err.value)
  assert '\n' not in message and 'KV page pool exhausted' in message and 'row 1' in message
  alloc.free(0)
  assert alloc.num_free == 3 and alloc.block_table[0].tolist() == [0, 0, 0]
  alloc.reserve(1, 12)  # now fits, on row 0's old pages
  assert set(alloc.block_table[1, 1:].tolist()) <= row0
  with pytest.raises(ValueError, match='max_pages_per_seq'):
    alloc.reserve(0, 13)
