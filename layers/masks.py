"""Visibility rules of attention (causal, local window, segments) and the ALiBi bias, defined once.

Every attention implementation (dense reference, blockwise scan, Pallas) calls these on the
query and
key positions it is working on, so the whole matrix and a block of it follow the same definition.
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


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


# --- Sparse patterns (sliding window, Longformer, BigBird), defined once --------------------------
# The same `sparse_visible` builds the explicit reference mask in the tests and masks the
# gathered key
# blocks of the blocked computation in `layers.sparse_attention`, so the two cannot disagree.

class SparsePattern(NamedTuple):
  """Which keys a sparse pattern connects to a query, before causality and segments (hashable).

  A key j is connected to query i if any term holds:
    window: (left, right) tokens, i - left <= j <= i + right (sliding window, Longformer);
    block_window: |i // block - j // block| <= block_window (BigBird's block-local part);
    global_tokens: i or j is one of these positions (they see, and are seen by, every position);
    random_blocks: j // block is in random_blocks[i // block] (BigBird; -1 entries are unused).
  """
  window: tuple | None = None
  block: int = 0
  block_window: int | None = None
  global_tokens: tuple = ()
  random_blocks: tuple = ()


def pattern_visible(q_pos, k_pos, pattern):
  """Whether `pattern` connects q_pos and k_pos (broadcasting; causality and segments not applied).

  NumPy positions give a NumPy result: the blocked kernels build their static masks at trace time,
  instead of leaving XLA to constant-fold them (slow to compile at long lengths).
  """
  xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
  conn = xp.zeros(np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos)), bool)
  if pattern.window is not None:
    left, right = pattern.window
    conn = conn | ((k_pos >= q_pos - left) & (k_pos <= q_pos + right))
  if pattern.block_window is not None:
    conn = conn | (xp.abs(q_pos // pattern.block - k_pos // pattern.block) <= pattern.block_window)
  if pattern.global_tokens:
    g = xp.asarray(pattern.global_tokens, xp.int32)
    conn = conn | xp.isin(q_pos, g) | xp.isin(k_pos, g)
  if pattern.random_blocks:
    table = xp.asarray(pattern.random_blocks, xp.int32)  # [num query blocks, r]
    qb = xp.clip(q_pos // pattern.block, 0, table.shape[0] - 1)
    kb = xp.where(k_pos >= 0, k_pos // pattern.block, -2)  # -2: never equal to a table entry
    conn = conn | xp.any(table[qb] == kb[..., None], axis=-1)
  return conn


def sparse_visible(q_pos, k_pos, pattern, *, is_causal=False, q_seg=None, k_seg=None):
  """`pattern_visible` and `visible` (causality, segments) together: the full visibility rule."""
  vis = pattern_visible(q_pos, k_pos, pattern)
  base = visible(q_pos, k_pos, is_causal=is_causal)
  vis = vis if base is None else vis & base
  if q_seg is not None:
    vis = (q_seg == k_seg) & vis  # a jax array on the left: a NumPy `vis` never sees a tracer
  return vis
