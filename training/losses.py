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

The final logits' soft cap (`model.final_logit_softcap`, c·tanh(x / c)) and PaLM's z-loss
(`train.z_loss`, z · (log Z)² per token) are taken in the tile too: the cap's derivative
1 - tanh²(x / c) and the z-loss's `w · 2z · log Z · softmax` enter the same `[R, V]` gradient of the
logits, so the objective with both keeps the three matmuls.
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


def _scan(hidden, table, targets, weights, rows, head, with_grads):
  """Per token the cross-entropy, whether the argmax is the target, and log Z (the log-sum-exp of
  the logits); with `with_grads` also the gradient of the objective sum(w · (cross-entropy +
  z · (log Z)²)) with respect to `hidden` and `table`. `head` = (c, z): the logits are
  c·tanh(hidden @ table.T / c) when c > 0 (models.stack.softcap), z the z-loss coefficient."""
  cap, z_loss = head
  b, t, d = hidden.shape
  v = table.shape[0]
  tiles = (_tiles(hidden.reshape(b * t, d), rows), _tiles(targets.reshape(b * t), rows),
           _tiles(weights.reshape(b * t), rows))  # [n, R, D], [n, R], [n, R]

  def tile(dtable, inputs):
    h, y, w = inputs  # [R, D], [R], [R]
    logits = jnp.einsum('RD,VD->RV', h, table, preferred_element_type=jnp.float32)  # [R, V]
    if cap:
      capped = jnp.tanh(logits / cap)  # [R, V]
      logits = cap * capped
    m = jnp.max(logits, -1)  # [R]
    # The softmax as jax.nn.softmax forms it, exp(l - m) / s: no exp overflows.
    e = jnp.exp(logits - m[:, None])  # [R, V]
    s = jnp.sum(e, -1)  # [R]
    log_z = m + jnp.log(s)  # [R]
    target_logit = jnp.take_along_axis(logits, y[:, None], -1)[:, 0]  # [R]
    ce = log_z - target_logit  # [R]
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)  # first of tied maxima
    if not with_grads:
      return dtable, (ce, correct, log_z)
    onehot = (y[:, None] == jnp.arange(v)).astype(jnp.float32)  # [R, V]
    # d sum(w · ce) / d logits = w · (softmax - onehot); the z-loss adds w · 2z · log Z · softmax.
    p = e * (1.0 / s)[:, None]  # [R, V]
    if z_loss:
      p = p * (1.0 + 2.0 * z_loss * log_z)[:, None]
    dlogits = w[:, None] * (p - onehot)  # [R, V]
    if cap:  # through the cap: d c·tanh(x / c) / dx = 1 - tanh²(x / c)
      dlogits = dlogits * (1.0 - capped * capped)
    # In the compute dtype, as the plain path's backward matmuls are.
    dlogits = dlogits.astype(hidden.dtype)  # [R, V]
    dh = jnp.einsum('RV,VD->RD', dlogits, table, preferred_element_type=jnp.float32)  # [R, D]
    dtable = dtable + jnp.einsum('RV,RD->VD', dlogits, h, preferred_element_type=jnp.float32)
    return dtable, (ce, correct, log_z, dh)

  init = jnp.zeros(table.shape, jnp.float32) if with_grads else None  # [V, D]
  dtable, out = jax.lax.scan(tile, init, tiles)
  ce, correct, log_z = (x.reshape(-1)[:b * t].reshape(b, t) for x in out[:3])  # [B, T] each
  if not with_grads:
    return ce, correct, log_z
  dh = out[3].reshape(-1, d)[:b * t].reshape(b, t, d)  # [B, T, D]
  return ce, correct, log_z, dh.astype(hidden.dtype), dtable.astype(table.dtype)


def _sums(ce, correct, log_z, weights, z_loss):
  """(objective, (loss, correct, z-loss) sums) of per-token values `[B, T]`."""
  loss_sum, z_sum = jnp.sum(ce * weights), jnp.sum(jnp.square(log_z) * weights)
  objective = loss_sum + z_loss * z_sum if z_loss else loss_sum
  return objective, (loss_sum, jnp.sum(correct * weights), z_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _objective(hidden, table, targets, weights, rows, head):
  """(sum of w · (cross-entropy + z · (log Z)²), (sum of w · cross-entropy, sum of w · [argmax ==
  target], sum of w · (log Z)²)); differentiable in the first alone (the caller stops the rest)."""
  ce, correct, log_z = _scan(hidden, table, targets, weights, rows, head, with_grads=False)
  return _sums(ce, correct, log_z, weights, head[1])


def _objective_fwd(hidden, table, targets, weights, rows, head):
  ce, correct, log_z, dh, dtable = _scan(hidden, table, targets, weights, rows, head,
                                         with_grads=True)
  z_loss = head[1]
  dweights = ce + z_loss * jnp.square(log_z) if z_loss else ce  # [B, T]
  return _sums(ce, correct, log_z, weights, z_loss), (dh, dtable, dweights)


def _objective_bwd(rows, head, residuals, cotangents):
  """The gradients formed in the forward pass, scaled by the objective's cotangent; the sums
  beside it carry none (`chunked_metrics` stops their gradients)."""
  del rows, head
  dh, dtable, dweights = residuals
  g = cotangents[0]
  return (g * dh).astype(dh.dtype), (g * dtable).astype(dtable.dtype), None, g * dweights


_objective.defvjp(_objective_fwd, _objective_bwd)


def chunked_metrics(hidden, table, targets, weights, chunk, softcap=0.0, z_loss=0.0):
  """`training.steps.compute_metrics` of the logits `hidden @ table.T`, never materialised.

  Args:
    hidden: `[B, T, D]` the final hidden states (after the final norm).
    table: `[V, D]` the output embedding (tied with the input embedding).
    targets: `[B, T]` int token ids.
    weights: `[B, T]` loss weights (0 on padding).
    chunk: C: each tile holds the logits of B·T·C / V tokens over the whole vocabulary, as many
      numbers as C vocabulary rows of the batch (the tokens are padded up to a multiple of it).
    softcap: c > 0: the logits are c·tanh(hidden @ table.T / c) (models.stack.softcap); 0 = none.
    z_loss: z > 0: PaLM's z-loss, z · (log Z)² per token of weight, joins the objective.

  Returns:
    {'loss_sum', 'correct_sum', 'weight_sum'}: the same sums as the plain path (to float
    rounding), 'loss_sum' differentiable with respect to `hidden` and `table`. With `z_loss` > 0
    also 'z_loss_sum' (sum of w · (log Z)², `training.steps.z_loss_sum`) and 'objective_sum'
    ('loss_sum' + z · 'z_loss_sum'): then the objective alone is differentiable (the gradient
    is formed for it in the forward pass) and the other sums are values.
  """
  b, t = targets.shape
  rows = tile_tokens(b, t, table.shape[0], chunk)
  objective, stats = _objective(hidden, table, targets, weights, rows,
                                (float(softcap), float(z_loss)))
  loss_sum, correct_sum, z_sum = jax.lax.stop_gradient(stats)
  sums = {'loss_sum': objective if not z_loss else loss_sum, 'correct_sum': correct_sum,
          'weight_sum': jnp.sum(weights)}
  if z_loss:
    sums.update(z_loss_sum=z_sum, objective_sum=objective)
  return sums
