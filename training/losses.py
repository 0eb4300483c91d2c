"""The output projection and cross-entropy computed a tile at a time (`train.loss_chunk`).

The plain path materialises the logits `[B, T, V]` in float32 and, for the backward pass, their
gradient: at V = 32k and T = 2k that alone dominates memory. Here the B·T tokens are cut into tiles
of R = B·T·C / V tokens, so that a tile's logits `[R, V]` hold as many numbers as C vocabulary rows
of the batch would (`[B, T, C]`): memory O(B·T·C) instead of O(B·T·V). A `lax.scan` over the tiles
computes each tile's logits against the whole tied embedding `[V, D]`, its log-sum-exp, loss and
accuracy, and (a custom VJP) at once the gradient of the summed loss with respect to the tile's
hidden states and, accumulated over the tiles, the embedding: `w · (softmax - onehot)` multiplied
into both. The backward pass only scales these by the incoming cotangent.

Why tokens and not vocabulary rows per tile: with a tile of C vocabulary rows a token's softmax
needs the log-sum-exp over all V first, so the backward pass must recompute every tile's logits
(four tile matmuls per step against the plain path's three; on the benchmark in
benchmarks/loss_chunk.py, where the output projection is most of the step's FLOPs, that ran at
0.79-0.89x the plain step). A tile spanning the whole vocabulary has its log-sum-exp at hand, so
its gradient is formed in the same pass: three matmuls, as the plain path. This is the
cut-cross-entropy idea (Wijmans et al. 2024), tiled over tokens as MaxText's vocabulary tiling does.
"""

import functools

import jax
import jax.numpy as jnp


def tile_tokens(batch, length, vocab, chunk):
  """R, the tokens per tile: as many logits as `chunk` vocabulary rows of the batch (at least 1)."""
  return max(1, batch * length * chunk // vocab)


def _tiles(x, rows, fill=0):
  """`[N, ...]` -> `[n, R, ...]`, padded with `fill` up to a multiple of R rows."""
  n = -(-x.shape[0] // rows)
  pad = n * rows - x.shape[0]
  if pad:
    x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1), constant_values=fill)
  return x.reshape(n, rows, *x.shape[1:])


def _scan(hidden, table, targets, weights, rows, with_grads):
  """Per token the cross-entropy and whether the argmax is the target; with `with_grads` also the
  gradient of sum(w · cross-entropy) with respect to `hidden` and `table`."""
  b, t, d = hidden.shape
  v = table.shape[0]
  tiles = (_tiles(hidden.reshape(b * t, d), rows), _tiles(targets.reshape(b * t), rows),
           _tiles(weights.reshape(b * t), rows))  # [n, R, D], [n, R], [n, R]

  def tile(dtable, inputs):
    h, y, w = inputs  # [R, D], [R], [R]
    logits = jnp.einsum('RD,VD->RV', h, table, preferred_element_type=jnp.float32)  # [R, V]
    m = jnp.max(logits, -1)  # [R]
    # The softmax as jax.nn.softmax forms it, exp(l - m) / s: no exp overflows.
    e = jnp.exp(logits - m[:, None])  # [R, V]
    s = jnp.sum(e, -1)  # [R]
    target_logit = jnp.take_along_axis(logits, y[:, None], -1)[:, 0]  # [R]
    ce = m + jnp.log(s) - target_logit  # [R]
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)  # first of tied maxima
    if not with_grads:
      return dtable, (ce, correct)
    onehot = (y[:, None] == jnp.arange(v)).astype(jnp.float32)  # [R, V]
    # d sum(w · ce) / d logits; in the compute dtype, as the plain path's backward matmuls are.
    dlogits = (w[:, None] * (e * (1.0 / s)[:, None] - onehot)).astype(hidden.dtype)  # [R, V]
    dh = jnp.einsum('RV,VD->RD', dlogits, table, preferred_element_type=jnp.float32)  # [R, D]
    dtable = dtable + jnp.einsum('RV,RD->VD', dlogits, h, preferred_element_type=jnp.float32)
    return dtable, (ce, correct, dh)

  init = jnp.zeros(table.shape, jnp.float32) if with_grads else None  # [V, D]
  dtable, out = jax.lax.scan(tile, init, tiles)
  ce, correct = (x.reshape(-1)[:b * t].reshape(b, t) for x in out[:2])  # [B, T] each
  if not with_grads:
    return ce, correct
  dh = out[2].reshape(-1, d)[:b * t].reshape(b, t, d)  # [B, T, D]
  return ce, correct, dh.astype(hidden.dtype), dtable.astype(table.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _loss_and_correct(hidden, table, targets, weights, rows):
  """(sum of w · cross-entropy, sum of w · [argmax == target]); differentiable in the first."""
  ce, correct = _scan(hidden, table, targets, weights, rows, with_grads=False)
  return jnp.sum(ce * weights), jnp.sum(correct * weights)


def _loss_fwd(hidden, table, targets, weights, rows):
  ce, correct, dh, dtable = _scan(hidden, table, targets, weights, rows, with_grads=True)
  return (jnp.sum(ce * weights), jnp.sum(correct * weights)), (dh, dtable, ce)


def _loss_bwd(rows, residuals, cotangents):
  """The gradients formed in the forward pass, scaled; the accuracy (a count) has none."""
  del rows
  dh, dtable, ce = residuals
  g = cotangents[0]
  return (g * dh).astype(dh.dtype), (g * dtable).astype(dtable.dtype), None, g * ce


_loss_and_correct.defvjp(_loss_fwd, _loss_bwd)


def chunked_metrics(hidden, table, targets, weights, chunk):
  """`training.steps.compute_metrics` of the logits `hidden @ table.T`, never materialised.

  Args:
    hidden: `[B, T, D]` the final hidden states (after the final norm).
    table: `[V, D]` the output embedding (tied with the input embedding).
    targets: `[B, T]` int token ids.
    weights: `[B, T]` loss weights (0 on padding).
    chunk: C: each tile holds the logits of B·T·C / V tokens over the whole vocabulary, as many
      numbers as C vocabulary rows of the batch (the tokens are padded up to a multiple of it).

  Returns:
    {'loss_sum', 'correct_sum', 'weight_sum'}: the same sums as the plain path (to float
    rounding), differentiable with respect to `hidden` and `table`.
  """
  b, t = targets.shape
  rows = tile_tokens(b, t, table.shape[0], chunk)
  loss_sum, correct_sum = _loss_and_correct(hidden, table, targets, weights, rows)
  return {'loss_sum': loss_sum, 'correct_sum': correct_sum, 'weight_sum': jnp.sum(weights)}
