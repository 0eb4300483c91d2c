"""KV-cache bytes of a batch of mixed-length sequences: contiguous (B x S_max) vs paged (pages used)

  python -m benchmarks.paged_cache [--batch=16] [--max_length=2048] [--seed=0]

Draws `batch` sequence lengths uniformly in [32, max_length], gives each row its pages with
`layers.paged_attention.PageAllocator`, and prints a markdown table of the cache bytes: the
contiguous cache reserves `max_length` slots per row; the paged one holds the pages the rows use
(the last page of each row partly empty) plus the null page. Bytes come from the caches' shapes
(`jax.eval_shape` of `init_cache` / `init_paged_cache`), nothing is allocated.
"""

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import attention
from layers import paged_attention

_BATCH = flags.DEFINE_integer('batch', 16, 'Sequences decoded together.')
_MAX_LENGTH = flags.DEFINE_integer('max_length', 2048, 'S_max: the contiguous cache length.')
_SEED = flags.DEFINE_integer('seed', 0, 'Draw of the sequence lengths.')
PAGE_SIZES = (8, 16, 64, 256)
# (name, layers, d_model, query heads, kv heads, dtype)
MODELS = (('tests: 2L d32 N4 K2 f32', 2, 32, 4, 2, jnp.float32),
          ('32L d4096 N32 K8 (GQA) bf16', 32, 4096, 32, 8, jnp.bfloat16))


def nbytes(tree):
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def layer_bytes(d_model, num_heads, num_kv_heads, dtype, *, batch, max_length, num_pages,
                page_size):
  """(contiguous, paged) bytes of one layer's cache, from the shapes `init_*cache` return."""
  with nnx.use_eager_sharding(False):
    layer = nnx.eval_shape(lambda: attention.Attention(d_model, num_heads, num_kv_heads,
                                                       rngs=nnx.Rngs(0)))
  contiguous = jax.eval_shape(lambda: layer.init_cache(batch, max_length, dtype))
  paged = jax.eval_shape(lambda: layer.init_paged_cache(num_pages, page_size, dtype))
  return nbytes(contiguous), nbytes(paged)


def main(_):
  b, s_max = _BATCH.value, _MAX_LENGTH.value
  lengths = np.random.default_rng(_SEED.value).integers(32, s_max + 1, size=b)
  print(f'{b} sequences, S_max {s_max}, lengths {sorted(lengths.tolist())} '
        f'(mean {lengths.mean():.0f}, {lengths.sum()} tokens)\n')
  print('| model | page size | pages used (+ null) | contiguous | paged | paged / contiguous |')
  print('|---|---|---|---|---|---|')
  for name, num_layers, d_model, n, k, dtype in MODELS:
    for page_size in PAGE_SIZES:
      alloc = paged_attention.PageAllocator(
          paged_attention.default_num_pages(b, s_max, page_size), page_size, b,
          paged_attention.pages_for(s_max, page_size))
      for row, length in enumerate(lengths):
        alloc.reserve(row, length)
      pages = alloc.pages_in_use + 1  # the null page is part of the pool
      contiguous, paged = layer_bytes(d_model, n, k, dtype, batch=b, max_length=s_max,
                                      num_pages=pages, page_size=page_size)
      # The block table is [B, S_max / page] int32, shared by the layers: counted once.
      table = b * paged_attention.pages_for(s_max, page_size) * 4
      contiguous, paged = num_layers * contiguous, num_layers * paged + table
      print(f'| {name} | {page_size} | {pages} | {contiguous / 2**20:,.2f} MiB | '
            f'{paged / 2**20:,.2f} MiB | {paged / contiguous:.3f} |')


if __name__ == '__main__':
  app.run(main)
