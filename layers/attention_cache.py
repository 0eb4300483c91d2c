"""The attention layer's KV-cache steps (autoregressive decoding), a base of Attention."""

import jax
import jax.numpy as jnp

from layers import attention_kernels
from layers import contract
from layers import masks
from layers import paged_attention


class CachedSteps:
  """The cached decoding steps of `layers.attention.Attention`: the contiguous and paged caches,
  one new token per row against them (`decode`, `cached_step`), and cross-attention to a cached
  encoder output (`decode_context`). They use the layer's `project`, `attend`, `output`,
  `norm_qk` and `with_layer_terms`, and its declarations (`cached_decoding`, `has_paged_cache`).
  """

  def init_cache(self, batch_size, max_length, dtype=jnp.float32):
    """An empty self-attention cache of `num_kv_heads` heads only (GQA/MQA shrink it by N/K).

    Returns:
      {'k': `[B, S_max, K, H]`, 'v': `[B, S_max, K, H]`} zeros.
    """
    shape = (batch_size, max_length, self.num_kv_heads, self.head_dim)
    return {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)}

  def init_paged_cache(self, num_pages, page_size, dtype=jnp.float32):
    """An empty page pool (layers.paged_attention) of `num_kv_heads` heads, shared by all rows.

    Returns:
      {'k_pages': `[P, page_size, K, H]`, 'v_pages': `[P, page_size, K, H]`} zeros.
    """
    if not self.has_paged_cache:
      # Variants decode through their own `decode` (sparse patterns sized from cache['k'],
      # recurrent prefix sums): none of them reads a page pool yet.
      raise NotImplementedError(f'{type(self).__name__} has no paged KV cache; decode it with the '
                                "contiguous cache (paged=False) or model.attention='dense'")
    return paged_attention.init_pages(num_pages, page_size, self.num_kv_heads, self.head_dim, dtype)

  def context_cache(self, context):
    """Cross-attention keys/values of an encoder output, computed once per source: {'k', 'v'}."""
    return {'k': self.norm_qk(None, self.key(context))[1],
            'v': self.value(context)}  # [B, S, K, H] each

  def decode(self, x, cache, index, *, position=None):
    """Causal self-attention of one new token per row against the cache, which it extends.

    Args:
      x: `[B, 1, D]` the new tokens' input.
      cache: {'k', 'v'} `[B, S_max, K, H]`; slots `< index` hold the row's earlier tokens.
      index: `[B]` int (or a scalar), each row's absolute position; its k/v go into that slot.
      position: None or the `layers.positions` object (absolute positions go to its hooks).

    Returns:
      (`[B, 1, D]`, the updated cache).
    """
    if self.cached_decoding != 'dense':
      # A variant with its own attention pattern needs its own cached step, not this dense one
      # (validation refuses decoding where `cached_decoding` is None).
      raise NotImplementedError(f'{type(self).__name__} has no KV-cache decode path; decode with '
                                "model.attention='dense' (or add one to the variant)")
    window = masks.normalize_window(self.local_window_size)
    return self.cached_step(x, cache, index, position=position, visible=lambda q_pos, k_pos: (
        masks.visible(q_pos, k_pos, is_causal=True, window=window)))

  def cached_step(self, x, cache, index, *, position, visible):
    """The body of `decode`: `visible(q_pos [B, 1, 1], k_pos [B, 1, S_max])` -> `[B, 1, S_max]`
    says which cached slots the new token sees (it must apply causality: later slots are empty).

    Variants with their own pattern (layers.sparse_attention) call this with theirs. `cache` is
    contiguous ({'k', 'v'} `[B, S_max, K, H]`) or paged ({'k_pages', 'v_pages'} `[P, page, K, H]`
    with 'block_table' `[B, M]`, S_max = M * page); only the storage differs: slot j of either is
    the row's absolute position j.
    """
    paged = paged_attention.is_paged(cache)
    b = x.shape[0]
    s_max = paged_attention.logical_length(cache) if paged else cache['k'].shape[1]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))  # [B]
    q, k, v = self.project(x)  # [B, 1, N, H], [B, 1, K, H], [B, 1, K, H]
    q_pos = index[:, None]  # [B, 1]
    k_pos = jnp.broadcast_to(jnp.arange(s_max, dtype=jnp.int32), (b, s_max))  # [B, S_max]
    terms = contract.NONE
    if position is not None:
      # The new key is rotated (RoPE) at its own absolute position before it is stored.
      q_in = q
      q, k, terms = position.in_attention(q, k, q_pos, q_pos, is_causal=True)
      if terms.bias is not None or terms.position_bias is not None or terms.mask is not None:
        # A score term over key positions (T5): recompute it against every cached slot; only the
        # terms of this call are used, so a method that also rotates q/k is not applied twice.
        # (keys of the cache's length, zeros: a method that also rotates k (xPos) needs the shape)
        _, _, terms = position.in_attention(
            q_in, jnp.zeros((b, s_max) + k.shape[2:], k.dtype), q_pos, k_pos, is_causal=True)
    if paged:
      cache = paged_attention.write(cache, index, k[:, 0], v[:, 0])
      keys, values = paged_attention.gather(cache)  # [B, S_max, K, H] each, in logical order
    else:
      rows = jnp.arange(b)
      cache = {'k': cache['k'].at[rows, index].set(k[:, 0].astype(cache['k'].dtype)),
               'v': cache['v'].at[rows, index].set(v[:, 0].astype(cache['v'].dtype))}
      keys, values = cache['k'], cache['v']
    bias, slopes = terms.bias, terms.alibi_slopes
    if terms.position_bias is not None:  # FIRE, KERPLE at the absolute positions: [B, N, 1, S_max]
      dense = terms.position_bias.dense()
      bias = dense if bias is None else bias + dense
    position_mask = terms.mask  # xPos's blockwise causal mask, [B, 1, 1, S_max]
    if slopes is not None:
      # The kernels compute ALiBi from array indices (0 for the single query row here): use the
      # absolute positions instead.
      alibi = jax.vmap(lambda qp, kp: masks.alibi_bias(slopes, qp[:, None], kp[None]))(
          q_pos, k_pos)  # [B, N, 1, S_max]
      bias = alibi if bias is None else bias + alibi
    # Slots after the row's position are empty (or stale): the causal mask on absolute positions.
    vis = visible(q_pos[:, :, None], k_pos[:, None, :])  # [B, 1, S_max]
    if position_mask is not None:
      vis = vis & position_mask[:, 0]
    # One query row gains nothing from a flash kernel: a kernel that does not declare `decodes`
    # leaves the step to the dense reference.
    impl = self.implementation if attention_kernels.KERNELS[self.implementation].decodes else 'xla'
    terms = self.with_layer_terms(contract.ScoreTerms(bias=bias, mask=vis[:, None]))
    out = self.attend(q, keys, values, terms, implementation=impl)  # [B, 1, N, H]
    return self.output(out, x), cache  # [B, 1, D]

  def decode_context(self, x, context_cache, context_mask=None):
    """Cross-attention of `x` `[B, 1, D]` to cached encoder keys/values; mask `[B, S]` True = real.

    Returns:
      `[B, 1, D]`.
    """
    q = self.norm_qk(self.query(x), None)[0]  # [B, 1, N, H]
    mask = None if context_mask is None else context_mask[:, None, None, :]  # [B, 1, 1, S]
    out = self.attend(q, context_cache['k'], context_cache['v'],
                      self.with_layer_terms(contract.ScoreTerms(mask=mask)))  # [B, 1, N, H]
    return self.output(out, x)
