"""Visibility rules of attention (causal, local window, segments) and the ALiBi bias, defined once.

Every attention implementation (dense reference, blockwise scan, Pallas) calls these on the query and
key positions it is working on, so the whole matrix and a block of it follow the same definition.
"""

import jax.numpy as jnp


def normalize_window(local_window_size):
  """Returns (left, right) or None, as `jax.nn.dot_product_attention` reads `local_window_size`."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):
    return (local_window_size, local_window_size)
  left, right = local_window_size
  return (int(left), int(right))


def visible(q_pos, k_pos, *, is_causal=False, window=None, q_seg=None, k_seg=None):
  """Whether query position q_pos may see key position k_pos (broadcasting).

  Args:
    q_pos: int array of query indices, e.g. `[T, 1]`.
    k_pos: int array of key indices, e.g. `[1, S]`.
    is_causal: keys after the query are hidden (j <= i, top-left aligned as in jax.nn).
    window: None or (left, right): key j is visible from i iff i - left <= j <= i + right.
    q_seg, k_seg: segment ids broadcastable like q_pos/k_pos (e.g. `[B, T, 1]`, `[B, 1, S]`);
      a key is visible only within its query's segment.

  Returns:
    A boolean array of the broadcast shape, or None when every key is visible.
  """
  vis = None

  def _and(a, b):
    return b if a is None else a & b

  if is_causal:
    vis = _and(vis, k_pos <= q_pos)
  if window is not None:
    left, right = window
    vis = _and(vis, (k_pos >= q_pos - left) & (k_pos <= q_pos + right))
  if q_seg is not None:
    vis = _and(vis, q_seg == k_seg)
  return vis


def alibi_bias(slopes, q_pos, k_pos):
  """ALiBi bias -slope * |i - j| per head.

  For causal attention only j <= i is seen, where this is the paper's -slope * (i - j); for
  bidirectional encoders it is the symmetric form.

  Args:
    slopes: `[N]` per-head slopes.
    q_pos: query indices `[T, 1]`.
    k_pos: key indices `[1, S]`.

  Returns:
    `[N, T, S]` float32 bias.
  """
  dist = jnp.abs(q_pos - k_pos).astype(jnp.float32)  # [T, S]
  return -slopes.astype(jnp.float32)[:, None, None] * dist[None]  # [N, T, S]
