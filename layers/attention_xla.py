"""Dense einsum-softmax attention: the reference every other implementation is tested against."""

import jax
import jax.numpy as jnp
from jax.extend import random as jax_random

from layers import flash_core
from layers import masks

# A large finite negative instead of -inf for hidden keys: a row with every key hidden stays finite
# (uniform), and is zeroed after the softmax, so neither the output nor its gradient is NaN.
NEG = float(jnp.finfo(jnp.float32).min)


def scores(query, key, bias=None, mask=None, *, scale, is_causal=False, window=None,
           alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, position_bias=None,
           softcap=None):
  """The logits the softmax sees and which keys each query sees: the one score computation that
  `attention`, `attention_weights` and the training statistics (`score_statistics`) share.

  Args:
    query: `[B, T, N, H]`.
    key: `[B, S, K, H]`, N a multiple of K (query head n reads key head n // G).
    bias: None or broadcastable to `[B, N, T, S]`, added to the scaled scores.
    mask: None or boolean broadcastable to `[B, N, T, S]`, True where a key is visible.
    scale: multiplies q·k (1/sqrt(H) keeps the scores at unit variance).
    is_causal, window, alibi_slopes, q_segment_ids, kv_segment_ids: see `layers.masks`.
    position_bias: None or a `layers.relative_bias.PositionBias` (FIRE, KERPLE), evaluated here on
      the whole `[T, S]` grid at its own positions.
    softcap: None/0 or c > 0: the logits (the added terms included) become c·tanh(logits / c).

  Returns:
    (logits `[B, N, T, S]` float32: the scaled scores plus the bias and ALiBi terms, capped, at
    every key;
    vis: boolean `[B, N, T, S]`, True where a key is visible, or None when every key is).
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
  if position_bias is not None:
    logits = logits + position_bias.dense()  # [B|1, N, T, S]
  logits = flash_core.softcap_logits(logits, softcap)
  vis = masks.visible(
      q_pos, k_pos, is_causal=is_causal, window=window,
      q_seg=None if q_segment_ids is None else q_segment_ids[:, :, None],
      k_seg=None if kv_segment_ids is None else kv_segment_ids[:, None, :])
  if vis is not None and vis.ndim == 3:
    vis = vis[:, None]  # [B, 1, T, S]
  if mask is not None:
    vis = mask if vis is None else jnp.logical_and(vis, mask)
  if vis is not None:
    vis = jnp.broadcast_to(vis, logits.shape)  # [B, N, T, S]
  return logits, vis


def with_sink(logits, vis, sinks):
  """`scores`' logits and visibility with the sink as one more, always visible key S + 1 (a
  normalisation over it, then dropping the column, gives attention with a sink of no value).

  Args:
    logits: `[B, N, T, S]`; vis: boolean `[B, N, T, S]` or None; sinks: `[N]`.

  Returns:
    (logits `[B, N, T, S + 1]`, vis `[B, N, T, S + 1]` or None).
  """
  column = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None],
                            logits.shape[:3] + (1,))  # [B, N, T, 1]
  logits = jnp.concatenate([logits, column], axis=-1)
  if vis is not None:
    vis = jnp.concatenate([vis, jnp.ones(column.shape, bool)], axis=-1)
  return logits, vis


def probabilities(logits, vis, sinks=None):
  """Softmax over S of `scores`' logits at the visible keys; a row with no visible key is zeros.
  `sinks` `[N]` join the denominator only (`with_sink`)."""
  if sinks is not None:
    return probabilities(*with_sink(logits, vis, sinks))[..., :-1]  # [B, N, T, S]
  if vis is not None:
    logits = jnp.where(vis, logits, NEG)
  probs = jax.nn.softmax(logits, axis=-1)  # [B, N, T, S]
  if vis is not None:
    probs = jnp.where(jnp.any(vis, axis=-1, keepdims=True), probs, 0.0)
  return probs


def dropout_seed(rng):
  """The two uint32 words of a jax key (typed or raw `uint32[2]`), the seed of `dropout_keep`."""
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  return jnp.asarray(rng, jnp.uint32).reshape(-1)[:2]  # [2]


def head_keys(seed, batch, heads):
  """Per (row, head) counter keys of the attention-dropout mask: two uint32 words `[B, N]` each."""
  b = jnp.arange(batch, dtype=jnp.uint32)[:, None]  # [B, 1]
  n = jnp.arange(heads, dtype=jnp.uint32)[None, :]  # [1, N]
  shape = (batch, heads)
  k0, k1 = (jnp.broadcast_to(w, shape) for w in (seed[0], seed[1]))
  return tuple(jax_random.threefry2x32_p.bind(k0, k1, jnp.broadcast_to(b, shape),
                                               jnp.broadcast_to(n, shape)))


def dropout_keep(keys, rate, q_pos, k_pos):
  """Which attention probabilities survive dropout at `rate`, as a function of the positions only.

  A counter-based draw (threefry of the (row, head) key and the absolute (query, key) position)
  rather than `jax.random.bernoulli` over an array shape: any tile of the `[B, N, T, S]` mask can
  be computed on its own and equals the same slice of the whole mask, so the blockwise kernel
  (which never forms the whole mask) drops exactly what the dense kernel drops.

  Args:
    keys: the two words of `head_keys`, each broadcastable to the output with trailing `[1, 1]`.
    rate: the dropout probability in (0, 1).
    q_pos: int `[T, 1]` query positions; k_pos: int `[1, S]` key positions.

  Returns:
    boolean, the broadcast of keys and positions (`[..., T, S]`), True where a probability is kept.
  """
  shape = jnp.broadcast_shapes(keys[0].shape, q_pos.shape, k_pos.shape)
  bits = jax_random.threefry2x32_p.bind(
      *(jnp.broadcast_to(w, shape) for w in keys),
      jnp.broadcast_to(q_pos.astype(jnp.uint32), shape),
      jnp.broadcast_to(k_pos.astype(jnp.uint32), shape))[0]
  # uint32 bits are uniform on [0, 2^32): P(bits >= rate·2^32) = 1 - rate.
  return bits >= jnp.uint32(min(int(round(rate * 2.0 ** 32)), 2 ** 32 - 1))


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, dropout_rate=0.0,
              dropout_seed=None, position_bias=None, softcap=None, sinks=None):
  """Materialises the `[B, N, T, S]` scores; the arguments are those of `dot_product_attention`.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, S, K, H]`, N a multiple of K (query head n reads key/value head n // G).
    bias, mask, scale, is_causal, window, alibi_slopes, q_segment_ids, kv_segment_ids,
      position_bias, softcap: see `scores`.
    sinks: None or `[N]` logits in the denominator only (`with_sink`).
    dropout_rate: drop each attention probability with this rate and scale the kept ones by
      1 / (1 - rate) (the Transformer's attention dropout); 0 = none.
    dropout_seed: `uint32[2]` (`dropout_seed(key)`), needed when `dropout_rate` > 0.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  logits, vis = scores(query, key, bias, mask, scale=scale, is_causal=is_causal, window=window,
                       alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                       kv_segment_ids=kv_segment_ids,
                       position_bias=position_bias, softcap=softcap)  # [B, N, T, S]
  probs = probabilities(logits, vis, sinks)  # [B, N, T, S]
  if dropout_rate > 0:
    probs = drop(probs, dropout_rate, dropout_seed)
  return combine(probs, value).astype(query.dtype)


def drop(probs, rate, seed):
  """Attention dropout on `[B, N, T, S]` probabilities: each dropped with `rate`, the kept ones
  scaled by 1 / (1 - rate); the same `seed` drops the same entries in every kernel."""
  b, n, t, s = probs.shape
  keys = tuple(w[:, :, None, None] for w in head_keys(seed, b, n))  # [B, N, 1, 1]
  keep = dropout_keep(keys, rate, jnp.arange(t)[:, None], jnp.arange(s)[None])
  return jnp.where(keep, probs / (1.0 - rate), 0.0)  # [B, N, T, S]


def combine(probs, value):
  """`[B, T, N, H]` float32: the values `[B, S, K, H]` weighted by `[B, N, T, S]` probabilities
  (query head n reads key/value head n // G)."""
  b, n, t, s = probs.shape
  k = value.shape[2]
  probs = probs.reshape(b, k, n // k, t, s)  # [B, K, G, T, S]
  out = jnp.einsum('BKGTS,BSKH->BTKGH', probs, value.astype(jnp.float32))  # [B, T, K, G, H]
  return out.reshape(b, t, n, value.shape[-1])


def attention_weights(query, key, bias=None, mask=None, *, scale, is_causal=False, window=None,
                      alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None,
                      position_bias=None):
  """The `[B, N, T, S]` float32 attention probabilities of `attention` (for plots and tests)."""
  logits, vis = scores(query.astype(jnp.float32), key.astype(jnp.float32), bias, mask,
                       scale=scale, is_causal=is_causal, window=window, alibi_slopes=alibi_slopes,
                       q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                       position_bias=position_bias)
  return probabilities(logits, vis)  # [B, N, T, S]


def score_statistics(logits, vis, real):
  """The softmax statistics the training diagnostics log, from `scores`' logits and visibility.

  Args:
    logits: `[B, N, T, S]` float32 from `scores`.
    vis: boolean `[B, N, T, S]` or None (every key visible).
    real: `[B, T]` float32, 1 on real query tokens (0 on padding).

  Returns:
    {'attn_max_logit': the largest logit at a visible key of a real query row that sees some key,
     'attn_entropy': the softmax entropy in nats, averaged over heads and those query rows,
     'attn_sink_share': the probability p_{i,0} those rows put on key 0 (the row's first token),
     averaged the same way: near 1 when the heads park their attention on the first token (an
     attention sink), 1/S-like when they spread it}.
  """
  if vis is None:
    vis = jnp.ones(logits.shape, bool)
  rows = real[:, None, :] * jnp.any(vis, -1)  # [B, N, T]: real queries that see some key
  max_logit = jnp.max(jnp.where(vis & (rows[..., None] > 0), logits, NEG))
  logp = jax.nn.log_softmax(jnp.where(vis, logits, NEG), -1)  # [B, N, T, S]
  # Hidden keys have probability 0 and add nothing (0·log 0 = 0), not 0·(-huge).
  entropy = -jnp.sum(jnp.where(vis, jnp.exp(logp) * logp, 0.0), -1)  # [B, N, T]
  sink = jnp.where(vis[..., 0], jnp.exp(logp[..., 0]), 0.0)  # [B, N, T]: p_{i,0}, 0 if hidden
  count = jnp.maximum(jnp.sum(rows), 1.0)
  return {'attn_max_logit': max_logit, 'attn_entropy': jnp.sum(entropy * rows) / count,
          'attn_sink_share': jnp.sum(sink * rows) / count}
