"""The output projection and cross-entropy computed a vocabulary tile at a time (`train.loss_chunk`).

The plain path materialises the logits `[B, T, V]` in float32 and, for the backward pass, their
gradient: at V = 32k and T = 2k that alone dominates memory. Here the tied output embedding
`[V, D]` is cut into tiles of C rows; a `lax.scan` over the tiles keeps, per token, the running
max and sum of the log-sum-exp (as in online softmax), the target's logit and the best logit so
far (for accuracy). The body is rematerialised (`jax.checkpoint`), so the backward pass recomputes
one `[B, T, C]` tile at a time: memory O(B·T·C) instead of O(B·T·V), for one more tile matmul.
This is the cut-cross-entropy idea (Wijmans et al. 2024), as MaxText and big_vision do it.
"""

import jax
import jax.numpy as jnp


def chunked_metrics(hidden, table, targets, weights, chunk):
  """`training.steps.compute_metrics` of the logits `hidden @ table.T`, never materialised.

  Args:
    hidden: `[B, T, D]` the final hidden states (after the final norm).
    table: `[V, D]` the output embedding (tied with the input embedding).
    targets: `[B, T]` int token ids.
    weights: `[B, T]` loss weights (0 on padding).
    chunk: C, vocabulary rows per tile (V is padded up to a multiple of C).

  Returns:
    {'loss_sum', 'correct_sum', 'weight_sum'}: the same sums as the plain path (to float
    rounding), differentiable with respect to `hidden` and `table`.
  """
  v, d = table.shape
  tiles = -(-v // chunk)
  padded = jnp.pad(table, ((0, tiles * chunk - v), (0, 0))).reshape(tiles, chunk, d)  # [n, C, D]
  b, t = targets.shape
  neg = jnp.full((b, t), -jnp.inf, jnp.float32)

  @jax.checkpoint
  def tile(carry, inputs):
    m, s, target_logit, best, best_id = carry  # [B, T] each
    rows, i = inputs  # [C, D], the tile's index
    logits = jnp.einsum('BTD,CD->BTC', hidden, rows,
                        preferred_element_type=jnp.float32)  # [B, T, C]
    ids = i * chunk + jnp.arange(chunk)  # [C] vocabulary ids of the tile
    logits = jnp.where(ids < v, logits, -jnp.inf)  # the padding rows are no tokens
    # The running max is a constant of the log-sum-exp's value: no gradient flows through it.
    m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(logits, -1)))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[..., None]), -1)
    local = targets - i * chunk  # [B, T] the target's column in this tile, if it is here
    here = (local >= 0) & (local < chunk)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, chunk - 1)[..., None], -1)[..., 0]
    target_logit = jnp.where(here, picked, target_logit)
    tile_best, tile_id = jnp.max(logits, -1), jnp.argmax(logits, -1) + i * chunk
    better = tile_best > best  # strict: ties keep the earlier (lower) id, as jnp.argmax does
    return (m_new, s, target_logit, jnp.where(better, tile_best, best),
            jnp.where(better, tile_id, best_id)), None

  init = (neg, jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.float32), neg,
          jnp.zeros((b, t), jnp.int32))
  (m, s, target_logit, _, best_id), _ = jax.lax.scan(tile, init, (padded, jnp.arange(tiles)))
  ce = m + jnp.log(s) - target_logit  # [B, T]
  correct = (best_id == targets).astype(jnp.float32)
  return {'loss_sum': jnp.sum(ce * weights), 'correct_sum': jnp.sum(correct * weights),
          'weight_sum': jnp.sum(weights)}
