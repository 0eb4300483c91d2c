"""A paged KV cache (vLLM's PagedAttention): fixed-size pages in one shared pool and a block table.

Each layer stores its keys/values in a pool {'k_pages', 'v_pages'} `[P, page_size, K, H]` shared by
every sequence of the batch; the block table `[B, max_pages_per_seq]` int32 (one for all layers)
maps a sequence's logical page i (its positions i * page_size ...) to a physical page of the pool.
Pages are handed out by `PageAllocator` on the host as sequences grow and returned when they end, so
the pool holds the tokens actually decoded rather than B x S_max.

Physical page 0 is the null page and is never allocated: unused block-table entries point at it, so
rows that have finished (or not started) write their step's keys/values there instead of into a
page that may now belong to another sequence. Its contents are garbage, and are never attended to:
every logical slot after a row's position is hidden by causality.

`layers.attention.Attention.cached_step` serves both caches: only the storage (`write`, `gather`)
differs, the projections, positions, biases and visibility rule are shared.
"""

import jax.numpy as jnp
import numpy as np

NULL_PAGE = 0


def is_paged(cache):
  """Whether a layer's cache is a page pool (else the contiguous {'k', 'v'} `[B, S_max, K, H]`)."""
  return 'k_pages' in cache


def pages_for(length, page_size):
  """Pages that hold `length` tokens."""
  return -(-int(length) // int(page_size))


def init_pages(num_pages, page_size, num_kv_heads, head_dim, dtype=jnp.float32):
  """An empty pool of one layer (page 0 included: the null page).

  Returns:
    {'k_pages', 'v_pages'} `[P, page_size, K, H]` zeros (finite, so a masked slot's value times its
    zero probability stays zero).
  """
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  return {'k_pages': jnp.zeros(shape, dtype), 'v_pages': jnp.zeros(shape, dtype)}


def logical_length(cache):
  """Positions the block table can address: max_pages_per_seq * page_size (S in `gather`)."""
  return cache['block_table'].shape[1] * cache['k_pages'].shape[1]


def write(cache, index, k, v):
  """Stores one new token per row in its page slot.

  Args:
    cache: {'k_pages', 'v_pages'} `[P, page_size, K, H]` and 'block_table' `[B, max_pages]`.
    index: `[B]` int, each row's absolute position (logical slot).
    k, v: `[B, K, H]` the new keys (already rotated at `index` for RoPE) and values.

  Returns:
    The cache with both pools updated.
  """
  page_size = cache['k_pages'].shape[1]
  rows = jnp.arange(index.shape[0])
  logical = jnp.minimum(index // page_size, cache['block_table'].shape[1] - 1)  # [B]
  page = cache['block_table'][rows, logical]  # [B] physical pages
  slot = index % page_size  # [B]
  return {**cache,
          'k_pages': cache['k_pages'].at[page, slot].set(k.astype(cache['k_pages'].dtype)),
          'v_pages': cache['v_pages'].at[page, slot].set(v.astype(cache['v_pages'].dtype))}


def gather(cache):
  """Each row's pages in logical order: slot j of the result is the row's position j.

  A reference gather (the pages are copied into one `[B, S, K, H]` view); vLLM's kernel reads them
  in place. Slots on pages not yet allocated come from the null page and must be masked (causality
  does it: they lie after the row's position).

  Returns:
    (keys, values), each `[B, max_pages * page_size, K, H]`.
  """
  table = cache['block_table']  # [B, M]
  b, m = table.shape

  def view(pages):
    _, page_size, k, h = pages.shape
    return pages[table].reshape(b, m * page_size, k, h)  # [B, M, page, K, H] -> [B, S, K, H]

  return view(cache['k_pages']), view(cache['v_pages'])


class PageAllocator:
  """Host-side bookkeeping of one page pool: a free list and the block table of `batch_size` rows.

  `reserve(row, length)` gives a row the pages for its first `length` tokens (allocating as it
  grows), `free(row)` returns them when its sequence ends. Physical page 0 (the null page) is never
  handed out; `block_table` is the `[B, max_pages_per_seq]` int32 array to pass with the cache.
  """

  def __init__(self, num_pages, page_size, batch_size, max_pages_per_seq, *, seed=None):
    """Args:
      num_pages: P, the pool size including the null page (so P - 1 pages can be allocated).
      page_size: tokens per page.
      batch_size: B, rows of the block table.
      max_pages_per_seq: its columns (pages_for(S_max, page_size)).
      seed: None hands out pages in order; an int shuffles the free list (tests: a non-contiguous
        assignment proves the block table is followed).
    """
    if num_pages < 2:
      raise ValueError(f'num_pages must be >= 2 (page 0 is the null page), got {num_pages}')
    self.num_pages, self.page_size = int(num_pages), int(page_size)
    order = np.arange(1, num_pages)
    if seed is not None:
      order = np.random.default_rng(seed).permutation(order)
    self._free = list(order[::-1])  # pop() from the end: the first page handed out is order[0]
    self.block_table = np.full((batch_size, max_pages_per_seq), NULL_PAGE, np.int32)
    self.num_allocated = np.zeros((batch_size,), np.int32)  # pages held by each row

  @property
  def num_free(self):
    return len(self._free)

  @property
  def pages_in_use(self):
    return int(self.num_allocated.sum())

  def reserve(self, row, length):
    """Allocates pages until `row` can hold `length` tokens (no-op if it already can).

    Raises:
      RuntimeError (one line) when the pool has no free page left.
      ValueError when `length` exceeds the block table's max_pages_per_seq * page_size.
    """
    need = pages_for(length, self.page_size)
    if need > self.block_table.shape[1]:
      raise ValueError(f'row {row}: {length} tokens need {need} pages, more than '
                       f'max_pages_per_seq={self.block_table.shape[1]}')
    while self.num_allocated[row] < need:
      if not self._free:
        raise RuntimeError(
            f'KV page pool exhausted: row {row} needs page {int(self.num_allocated[row])} for '
            f'{length} tokens but all {self.num_pages - 1} pages of {self.page_size} tokens are in '
            'use; raise num_pages or decode fewer rows at once')
      self.block_table[row, self.num_allocated[row]] = self._free.pop()
      self.num_allocated[row] += 1

  def free(self, row):
    """Returns `row`'s pages to the pool; its table row points at the null page again."""
    held = self.block_table[row, :self.num_allocated[row]]
    self._free.extend(int(p) for p in held[::-1])  # LIFO: a freed page is the next one reused
    self.block_table[row] = NULL_PAGE
    self.num_allocated[row] = 0


def default_num_pages(batch_size, max_length, page_size):
  """A pool that can hold every row at `max_length` (no sharing needed), plus the null page."""
  return batch_size * pages_for(max_length, page_size) + 1

