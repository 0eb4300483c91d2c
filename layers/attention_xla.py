"""Dense einsum-softmax attention: the reference every other implementation is tested against."""

import jax
import jax.numpy as jnp

from layers import masks


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None):
  """Materialises the `[B, N, T, S]` scores; the arguments are those of `dot_product_attention`.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, S, K, H]`, N a multiple of K (query head n reads key/value head n // G).
    bias: None or broadcastable to `[B, N, T, S]`, added to the scaled scores.
    mask: None or boolean broadcastable to `[B, N, T, S]`, True where a key is visible.
    scale: multiplies q·k (1/sqrt(H) keeps the scores at unit variance).
    is_causal, window, alibi_slopes, q_segment_ids, kv_segment_ids: see `layers.masks`.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  g = n // k
  q = query.reshape(b, t, k, g, h)  # [B, T, K, G, H]
  logits = jnp.einsum('BTKGH,BSKH->BKGTS', q, key,
                      preferred_element_type=jnp.float32).reshape(b, n, t, s)  # [B, N, T, S]
  logits = logits * scale
  q_pos = jnp.arange(t)[:, None]  # [T, 1]
  k_pos = jnp.arange(s)[None, :]  # [1, S]
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if alibi_slopes is not None:
    logits = logits + masks.alibi_bias(alibi_slopes, q_pos, k_pos)[None]
  vis = masks.visible(
      q_pos, k_pos, is_causal=is_causal, window=window,
      q_seg=None if q_segment_ids is None else q_segment_ids[:, :, None],
      k_seg=None if kv_segment_ids is None else kv_segment_ids[:, None, :])
  if vis is not None and vis.ndim == 3:
    vis = vis[:, None]  # [B, 1, T, S]
  if mask is not None:
    vis = mask if vis is None else jnp.logical_and(vis, mask)
  if vis is not None:
    vis = jnp.broadcast_to(vis, logits.shape)
    # A large finite negative instead of -inf: a row with every key hidden stays finite (uniform),
    # and is zeroed below, so neither the output nor its gradient is NaN.
    logits = jnp.where(vis, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1)  # [B, N, T, S]
  if vis is not None:
    probs = jnp.where(jnp.any(vis, axis=-1, keepdims=True), probs, 0.0)
  probs = probs.reshape(b, k, g, t, s)
  out = jnp.einsum('BKGTS,BSKH->BTKGH', probs, value.astype(jnp.float32))  # [B, T, K, G, H]
  return out.reshape(b, t, n, value.shape[-1]).astype(query.dtype)


def attention_weights(query, key, bias=None, mask=None, *, scale, is_causal=False, window=None,
                      alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None):
  """The `[B, N, T, S]` attention probabilities of `attention` (for plots and tests)."""
  b, t, n, h = query.shape
  s = key.shape[1]
  # Probabilities are the output of attention over one-hot values: reuse the reference itself so the
  # maps can never disagree with what the model computes.
  eye = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32)[None, :, None, :],
                         (b, s, key.shape[2], s))  # [B, S, K, S]
  probs = attention(query.astype(jnp.float32), key.astype(jnp.float32), eye, bias, mask,
                    scale=scale, is_causal=is_causal, window=window, alibi_slopes=alibi_slopes,
                    q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)  # [B, T, N, S]
  return probs.transpose(0, 2, 1, 3)  # [B, N, T, S]
