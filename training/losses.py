"""The output projection and cross-entropy computed a tile at a time (`train.loss_chunk`).

The plain path materialises the logits `[B, T, V]` in float32 and, for the backward pass, their
gradient: at V = 32k and T = 2k that alone dominates memory. Here each row's T positions are cut
into tiles of T_c = T·C / V positions, so that a tile's logits `[B, T_c, V]` (R = B·T_c tokens)
hold as many numbers as C vocabulary rows of the batch would (`[B, T, C]`): memory O(B·T·C)
instead of O(B·T·V). The tiles cut the length, never the batch: a tile holds every row, so the
rows stay split over the mesh's batch axes and each device computes the logits of its own rows
(tiles of the flattened B·T tokens would put each tile on one device's rows, and every device
would compute every tile, its hidden states gathered). A `lax.scan` over the tiles
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


def tile_length(length, vocab, chunk):
  """T_c, the positions of each row per tile: as many logits as `chunk` vocabulary rows of the
  batch (at least 1)."""
  return max(1, length * chunk // vocab)


def tile_tokens(batch, length, vocab, chunk):
  """R = B·T_c, the tokens per tile (every row's T_c positions)."""
  return batch * tile_length(length, vocab, chunk)


def _tiles(x, cols, fill=0):
  """`[B, T, ...]` -> `[n, B, T_c, ...]` (T_c = `cols`), T padded with `fill` up to a multiple of
  T_c: the tiles cut the length, the batch axis stays whole in each."""
  b, t = x.shape[:2]
  n = -(-t // cols)
  pad = n * cols - t
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
  return jnp.moveaxis(x.reshape(b, n, cols, *x.shape[2:]), 1, 0)


def _untile(x, t):
  """`[n, B, T_c, ...]` -> `[B, T, ...]`, the padding dropped."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :t]


def _scan(hidden, table, targets, weights, cols, head, with_grads):
  """Per token the cross-entropy, whether the argmax is the target, and log Z (the log-sum-exp of
  the logits); with `with_grads` also the gradient of the objective sum(w · (cross-entropy +
  z · (log Z)²)) with respect to `hidden` and `table`. `head` = (c, z): the logits are
  c·tanh(hidden @ table.T / c) when c > 0 (models.stack.softcap), z the z-loss coefficient."""
  cap, z_loss = head
  t = hidden.shape[1]
  v = table.shape[0]
  tiles = (_tiles(hidden, cols), _tiles(targets, cols),
           _tiles(weights, cols))  # [n, B, T_c, D], [n, B, T_c], [n, B, T_c]

  def tile(dtable, inputs):
    h, y, w = inputs  # [B, T_c, D], [B, T_c], [B, T_c]
    logits = jnp.einsum('BRD,VD->BRV', h, table, preferred_element_type=jnp.float32)  # [B, T_c, V]
    if cap:
      capped = jnp.tanh(logits / cap)  # [B, T_c, V]
      logits = cap * capped
    m = jnp.max(logits, -1)  # [B, T_c]
    # The softmax as jax.nn.softmax forms it, exp(l - m) / s: no exp overflows.
    e = jnp.exp(logits - m[..., None])  # [B, T_c, V]
    s = jnp.sum(e, -1)  # [B, T_c]
    log_z = m + jnp.log(s)  # [B, T_c]
    target_logit = jnp.take_along_axis(logits, y[..., None], -1)[..., 0]  # [B, T_c]
    ce = log_z - target_logit  # [B, T_c]
    correct = (jnp.argmax(logits, -1) == y).astype(jnp.float32)  # first of tied maxima
    if not with_grads:
      return dtable, (ce, correct, log_z)
    onehot = (y[..., None] == jnp.arange(v)).astype(jnp.float32)  # [B, T_c, V]
    # d sum(w · ce) / d logits = w · (softmax - onehot); the z-loss adds w · 2z · log Z · softmax.
    p = e * (1.0 / s)[..., None]  # [B, T_c, V]
    if z_loss:
      p = p * (1.0 + 2.0 * z_loss * log_z)[..., None]
    dlogits = w[..., None] * (p - onehot)  # [B, T_c, V]
    if cap:  # through the cap: d c·tanh(x / c) / dx = 1 - tanh²(x / c)
      dlogits = dlogits * (1.0 - capped * capped)
    # In the compute dtype, as the plain path's backward matmuls are.
    dlogits = dlogits.astype(hidden.dtype)  # [B, T_c, V]
    dh = jnp.einsum('BRV,VD->BRD', dlogits, table,
                    preferred_element_type=jnp.float32)  # [B, T_c, D]
    dtable = dtable + jnp.einsum('BRV,BRD->VD', dlogits, h, preferred_element_type=jnp.float32)
    return dtable, (ce, correct, log_z, dh)

  init = jnp.zeros(table.shape, jnp.float32) if with_grads else None  # [V, D]
  dtable, out = jax.lax.scan(tile, init, tiles)
  ce, correct, log_z = (_untile(x, t) for x in out[:3])  # [B, T] each
  if not with_grads:
    return ce, correct, log_z
  dh = _untile(out[3], t)  # [B, T, D]
  return ce, correct, log_z, dh.astype(hidden.dtype), dtable.astype(table.dtype)


def _sums(ce, correct, log_z, weights, z_loss):
  """(objective, (loss, correct, z-loss) sums) of per-token values `[B, T]`."""
  loss_sum, z_sum = jnp.sum(ce * weights), jnp.sum(jnp.square(log_z) * weights)
  objective = loss_sum + z_loss * z_sum if z_loss else loss_sum
  return objective, (loss_sum, jnp.sum(correct * weights), z_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _objective(hidden, table, targets, weights, cols, head):
  """(sum of w · (cross-entropy + z · (log Z)²), (sum of w · cross-entropy, sum of w · [argmax ==
  target], sum of w · (log Z)²)); differentiable in the first alone (the caller stops the rest)."""
  ce, correct, log_z = _scan(hidden, table, targets, weights, cols, head, with_grads=False)
  return _sums(ce, correct, log_z, weights, head[1])


def _objective_fwd(hidden, table, targets, weights, cols, head):
  ce, correct, log_z, dh, dtable = _scan(hidden, table, targets, weights, cols, head,
                                         with_grads=True)
  z_loss = head[1]
  dweights = ce + z_loss * jnp.square(log_z) if z_loss else ce  # [B, T]
  return _sums(ce, correct, log_z, weights, z_loss), (dh, dtable, dweights)


def _objective_bwd(cols, head, residuals, cotangents):
  """The gradients formed in the forward pass, scaled by the objective's cotangent; the sums
  beside it carry none (`chunked_metrics` stops their gradients)."""
  del cols, head
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
    chunk: C: each tile holds the logits of T·C / V positions of every row over the whole
      vocabulary, as many numbers as C vocabulary rows of the batch (the length is padded up to a
      multiple of it).
    softcap: c > 0: the logits are c·tanh(hidden @ table.T / c) (models.stack.softcap); 0 = none.
    z_loss: z > 0: PaLM's z-loss, z · (log Z)² per token of weight, joins the objective.

  Returns:
    {'loss_sum', 'correct_sum', 'weight_sum'}: the same sums as the plain path (to float
    rounding), 'loss_sum' differentiable with respect to `hidden` and `table`. With `z_loss` > 0
    also 'z_loss_sum' (sum of w · (log Z)², `training.steps.z_loss_sum`) and 'objective_sum'
    ('loss_sum' + z · 'z_loss_sum'): then the objective alone is differentiable (the gradient
    is formed for it in the forward pass) and the other sums are values.
  """
  cols = tile_length(targets.shape[1], table.shape[0], chunk)
  objective, stats = _objective(hidden, table, targets, weights, cols,
                                (float(softcap), float(z_loss)))
  loss_sum, correct_sum, z_sum = jax.lax.stop_gradient(stats)
  sums = {'loss_sum': objective if not z_loss else loss_sum, 'correct_sum': correct_sum,
          'weight_sum': jnp.sum(weights)}
  if z_loss:
    sums.update(z_loss_sum=z_sum, objective_sum=objective)
  return sums
