"""Blockwise (FlashAttention-2) exact attention in pure JAX: online softmax over key blocks,
O(T) memory.

The forward pass visits query blocks one after another and, for each, only the band of key blocks
that `is_causal`/`window` leave visible, carrying the running max, denominator and un-normalised
output. A `jax.custom_vjp` keeps only the output and the per-row logsumexp as residuals and
recomputes the probabilities block by block in the backward pass; autodiff through the loops would
instead store every block's probabilities and make memory quadratic again. The tiling
(`TileConfig`, the visible-block bands) and the per-block pieces (logits, online update, finalize,
the tile gradients, the custom VJP) are `layers.flash_core`'s, shared with the ring and Pallas
kernels; this file keeps the blocked layout and the scans over it.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from layers import attention_xla
from layers import flash_core

# Measured on a 2-core CPU (benchmarks/attention.py): 512x512 blocks keep the per-block matmuls
# large enough to run at matmul speed while the [B, N, bq, bk] probability tile stays in
# cache-sized memory.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


def block_logits(q, k, i, j, cfg, *, bias=None, mask=None, slopes=None, q_seg=None, kv_seg=None,
                 pos_bias=None):
  """Scaled, biased scores of query block i against key block j, -inf where hidden.

  Args:
    q: `[B, K, G, bq, H]`; k: `[B, K, bk, H]`.
    i, j: block indices (traced).
    bias: None or `[b, K|1, G|1, bq|1, bk|1]` float32 (already sliced to the block).
    mask: None or boolean, shaped like `bias`.
    slopes: None or `[N]` float32 ALiBi slopes.
    q_seg, kv_seg: None or `[B, bq]`, `[B, bk]`.
    pos_bias: None or (params, q_pos `[B|1, bq]`, k_pos `[B|1, bk]`) of `cfg.bias_fn`.

  Returns:
    `[B, K, G, bq, bk]` float32.
  """
  kh, g, bq, _ = q.shape[1:]
  bk = k.shape[2]
  qk = jnp.einsum('BKGTH,BKSH->BKGTS', q, k, preferred_element_type=jnp.float32)
  return flash_core.tile_logits(
      qk, i * cfg.block_q + jnp.arange(bq)[:, None], j * cfg.block_k + jnp.arange(bk)[None, :],
      scale=cfg.scale, is_causal=cfg.is_causal, window=cfg.window,
      # Keys past S are padding of the last block.
      kv_len=cfg.kv_len if cfg.kv_len % cfg.block_k else None, bias=bias,
      slope=None if slopes is None else slopes.reshape(kh, g, 1, 1),
      position_bias=None if pos_bias is None else _tile_position_bias(cfg, *pos_bias).reshape(
          -1, kh, g, bq, bk),
      q_seg=None if q_seg is None else q_seg[:, None, None, :, None],  # [B, 1, 1, bq, 1]
      k_seg=None if kv_seg is None else kv_seg[:, None, None, None, :], mask=mask,
      softcap=cfg.softcap)


def _tile_keep(drop_keys, i, j, cfg):
  """The attention-dropout mask of tile (i, j), `[B, K, G, bq, bk]`: the same slice of the whole
  `[B, N, T, S]` mask that attention_xla draws (attention_xla.dropout_keep is counter-based), so
  the result does not depend on the tile sizes and needs no stored mask for the backward pass."""
  keys = tuple(w[..., None, None] for w in drop_keys)  # [B, K, G, 1, 1]
  q_pos = i * cfg.block_q + jnp.arange(cfg.block_q)[:, None]  # [bq, 1]
  k_pos = j * cfg.block_k + jnp.arange(cfg.block_k)[None, :]  # [1, bk]
  return attention_xla.dropout_keep(keys, cfg.dropout_rate, q_pos, k_pos)


def _dropped(x, drop_keys, i, j, cfg):
  """`x` `[B, K, G, bq, bk]` with tile (i, j)'s dropped entries zeroed, the kept ones scaled."""
  if drop_keys is None:
    return x
  return jnp.where(_tile_keep(drop_keys, i, j, cfg), x / (1.0 - cfg.dropout_rate), 0.0)


def _tile_position_bias(cfg, params, q_pos, k_pos):
  """`cfg.bias_fn` on one tile's positions: `[B|1, N, bq, bk]` (no `[T, S]` bias is formed)."""
  return cfg.bias_fn(params, q_pos[:, :, None], k_pos[:, None, :])


def _tile_pb(pb, qp, j):
  """The `pos_bias` of `block_logits` for a query block's positions `qp` and key block j."""
  return None if pb is None else (pb[0], qp, pb[2][j])


def _slice_bt(x, i, j, cfg):
  """Block (i, j) of a `[b, K|1, G|1, Tp|1, Sp|1]` bias or mask; size-1 axes stay broadcast."""
  if x is None:
    return None
  if x.shape[3] != 1:
    x = lax.dynamic_slice_in_dim(x, i * cfg.block_q, cfg.block_q, axis=3)
  if x.shape[4] != 1:
    x = lax.dynamic_slice_in_dim(x, j * cfg.block_k, cfg.block_k, axis=4)
  return x


def _forward(cfg, q, k, v, bias, mask, slopes, q_seg, kv_seg, drop_keys, pb, sinks):
  """Online-softmax forward over blocked inputs.

  Args:
    q: `[nq, B, K, G, bq, H]`; k, v: `[nk, B, K, bk, H]`; bias/mask: see `_slice_bt`;
    q_seg: `[nq, B, bq]`; kv_seg: `[nk, B, bk]`; pb: None or (params, q_pos `[nq, B|1, bq]`,
    k_pos `[nk, B|1, bk]`) of `cfg.bias_fn`; drop_keys: None or the two uint32 words
    `[B, K, G]` of attention_xla.head_keys (attention dropout at `cfg.dropout_rate`); sinks:
    None or `[K, G]` float32 sink logits.

  Returns:
    out `[nq, B, K, G, bq, H]` float32 and logsumexp `[nq, B, K, G, bq]` (+inf on empty rows).
  """
  nq, nk = q.shape[0], k.shape[0]

  def one_query_block(_, xs):
    i, qb, qs, qp = xs

    def body(j, carry):
      s = block_logits(qb, k[j], i, j, cfg, bias=_slice_bt(bias, i, j, cfg),
                       mask=_slice_bt(mask, i, j, cfg), slopes=slopes, q_seg=qs,
                       kv_seg=None if kv_seg is None else kv_seg[j],
                       pos_bias=_tile_pb(pb, qp, j))  # [B, K, G, bq, bk]
      # Dropout acts after the softmax: the denominator sums the undropped probabilities.
      drop = functools.partial(_dropped, drop_keys=drop_keys, i=i, j=j, cfg=cfg)
      return flash_core.online_update(carry, s, v[j], dropout=drop)

    lo, hi = flash_core.key_block_band(i, cfg, nk)
    carry = lax.fori_loop(lo, hi, body, flash_core.init_carry(qb.shape[:-1], qb.shape[-1]))
    sink = None if sinks is None else sinks[:, :, None]  # [K, G, 1]
    # [B, K, G, bq, H] (zeros on empty rows), [B, K, G, bq]
    return None, flash_core.finalize(carry, sink)

  _, (out, lse) = lax.scan(one_query_block, None,
                           (jnp.arange(nq), q, q_seg, None if pb is None else pb[1]))
  return out, lse


def _backward(cfg, args, out, lse, d_out):
  """FlashAttention-2 backward: per key block, sweep its query band, recomputing probabilities."""
  q, k, v, bias, mask, slopes, q_seg, kv_seg, drop_keys, pb, sinks = args
  nq, nk = q.shape[0], k.shape[0]
  delta = flash_core.backward_delta(out, d_out)  # [nq, B, K, G, bq]
  do = d_out.astype(q.dtype)

  def one_key_block(carry, xs):
    j, kb, vb, ks = xs

    def body(i, carry):
      dk, dv, dq, dbias, dpb = carry
      bias_ij = _slice_bt(bias, i, j, cfg)
      s = block_logits(q[i], kb, i, j, cfg, bias=bias_ij, mask=_slice_bt(mask, i, j, cfg),
                       slopes=slopes, q_seg=None if q_seg is None else q_seg[i], kv_seg=ks,
                       pos_bias=_tile_pb(pb, None if pb is None else pb[1][i], j))
      drop = None if drop_keys is None else functools.partial(
          _dropped, drop_keys=drop_keys, i=i, j=j, cfg=cfg)
      grads = flash_core.tile_grads(s, lse[i], delta[i], q[i], kb, vb, do[i],
                                    softcap=cfg.softcap, scale=cfg.scale, dropout=drop)
      ds = grads.ds  # [B, K, G, bq, bk]: d loss / d scaled-and-biased score (before the cap)
      dk, dv, dq = dk + grads.dk, dv + grads.dv, dq.at[i].add(grads.dq)
      if dbias is not None:
        # Sum over the axes the bias broadcasts along, then add into its block.
        axes = tuple(a for a in range(5) if bias.shape[a] == 1 and ds.shape[a] != 1)
        db = jnp.sum(ds, axis=axes, keepdims=True)
        start = (0, 0, 0, 0 if bias.shape[3] == 1 else i * cfg.block_q,
                 0 if bias.shape[4] == 1 else j * cfg.block_k)
        dbias = lax.dynamic_update_slice(
            dbias, lax.dynamic_slice(dbias, start, db.shape) + db, start)
      if dpb is not None:
        qp, kp = pb[1][i], pb[2][j]  # [B|1, bq], [B|1, bk]
        _, vjp = jax.vjp(lambda params: _tile_position_bias(cfg, params, qp, kp), pb[0])
        ct = ds.reshape(ds.shape[0], -1, *ds.shape[3:])  # [B, N, bq, bk]
        if qp.shape[0] == 1:  # positions shared by the rows: so is the bias
          ct = ct.sum(0, keepdims=True)
        dpb = jax.tree.map(jnp.add, dpb, vjp(ct)[0])
      return dk, dv, dq, dbias, dpb

    dq, dbias, dpb = carry
    init = (jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32), dq, dbias, dpb)
    lo, hi = flash_core.query_block_band(j, cfg, nq)
    dk, dv, dq, dbias, dpb = lax.fori_loop(lo, hi, body, init)
    return (dq, dbias, dpb), (dk, dv)

  dbias0 = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
  dpb0 = None if pb is None else jax.tree.map(jnp.zeros_like, pb[0])
  (dq, dbias, dpb), (dk, dv) = lax.scan(
      one_key_block, (jnp.zeros(q.shape, jnp.float32), dbias0, dpb0),
      (jnp.arange(nk), k, v, kv_seg))
  dsinks = None
  if sinks is not None:
    dsinks = flash_core.sink_grad(sinks[:, :, None], lse, delta, (0, 1, 4))  # [K, G]
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None if bias is None else dbias.astype(bias.dtype), None, None, None, None, None,
          None if pb is None else (dpb, None, None), dsinks)


# Only O(T) residuals: inputs, output and one logsumexp per row (the dropout mask is redrawn).
_flash = flash_core.flash_vjp(_forward, _backward)


def _blocked_bt(x, n, k, t_pad, s_pad):
  """A bias/mask broadcastable to `[B, N, T, S]` as `[b, K|1, G|1, Tp|1, Sp|1]`, padded."""
  if x is None:
    return None
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if x.shape[2] != 1:
    x = flash_core.pad_axis(x, 2, t_pad, False if x.dtype == jnp.bool_ else 0)
  if x.shape[3] != 1:
    x = flash_core.pad_axis(x, 3, s_pad, False if x.dtype == jnp.bool_ else 0)
  heads = (k, n // k) if x.shape[1] == n else (1, 1)
  return x.reshape(x.shape[:1] + heads + x.shape[2:])


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, dropout_rate=0.0,
              dropout_seed=None, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K,
              position_bias=None, softcap=None, sinks=None):
  """Exact attention in `[block_q, block_k]` tiles; the arguments are those of `attention_xla`.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, S, K, H]`, N a multiple of K (query heads n share key/value head n // G).
    bias: None or broadcastable to `[B, N, T, S]` (receives a gradient).
    mask: None or boolean broadcastable to `[B, N, T, S]`, True where visible.
    scale, is_causal, window, alibi_slopes, q_segment_ids, kv_segment_ids: see `attention_xla`.
    dropout_rate, dropout_seed: attention dropout, see `attention_xla.attention` (the same seed
      drops the same probabilities there and here, whatever the tile sizes).
    position_bias: None or a `layers.relative_bias.PositionBias` (FIRE, KERPLE): its function is
      evaluated per tile from the tile's positions, and its parameters receive a gradient.
    softcap: None/0 or c > 0, the logit soft cap (`flash_core.tile_logits`).
    sinks: None or `[N]` sink logits in the denominator (`flash_core.finalize`); they receive a
      gradient.
    block_q, block_k: tile sizes (clipped to T and S); T and S need not be multiples of them.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  g = n // kh
  bq, bk = min(block_q, t), min(block_k, s)
  nq, nk = -(-t // bq), -(-s // bk)
  tp, sp = nq * bq, nk * bk
  cfg = flash_core.TileConfig(float(scale), bool(is_causal),
                              None if window is None else tuple(window), t, s, bq, bk,
                              float(dropout_rate), softcap=float(softcap or 0.0))

  # Block-major layouts, so that a block is one contiguous leading-axis slice.
  pad = flash_core.pad_axis
  q = pad(query, 1, tp).reshape(b, nq, bq, kh, g, h).transpose(1, 0, 3, 4, 2, 5)
  k = pad(key, 1, sp).reshape(b, nk, bk, kh, h).transpose(1, 0, 3, 2, 4)  # [nk, B, K, bk, H]
  v = pad(value, 1, sp).reshape(b, nk, bk, kh, -1).transpose(1, 0, 3, 2, 4)
  q_seg = kv_seg = None
  if q_segment_ids is not None:
    q_seg = pad(q_segment_ids, 1, tp).reshape(b, nq, bq).transpose(1, 0, 2)  # [nq, B, bq]
    kv_seg = pad(kv_segment_ids, 1, sp).reshape(b, nk, bk).transpose(1, 0, 2)  # [nk, B, bk]
  bias5 = _blocked_bt(None if bias is None else bias.astype(jnp.float32), n, kh, tp, sp)
  mask5 = _blocked_bt(None if mask is None else mask.astype(jnp.bool_), n, kh, tp, sp)
  slopes = None if alibi_slopes is None else lax.stop_gradient(alibi_slopes).astype(jnp.float32)

  drop_keys = None
  if dropout_rate > 0:
    drop_keys = tuple(w.reshape(b, kh, g) for w in attention_xla.head_keys(dropout_seed, b, n))
  pb = None
  if position_bias is not None:
    qp, kp = position_bias.q_pos, position_bias.k_pos  # [B|1, T], [B|1, S]
    qp = pad(qp, 1, tp).reshape(qp.shape[0], nq, bq).transpose(1, 0, 2)  # [nq, B|1, bq]
    kp = pad(kp, 1, sp).reshape(kp.shape[0], nk, bk).transpose(1, 0, 2)  # [nk, B|1, bk]
    pb = (position_bias.params, qp, kp)
    cfg = cfg._replace(bias_fn=position_bias.fn)

  sinks2 = None if sinks is None else sinks.astype(jnp.float32).reshape(kh, g)  # [K, G]
  out = _flash(cfg, q, k, v, bias5, mask5, slopes, q_seg, kv_seg, drop_keys, pb,
               sinks2)  # [nq, B, K, G, bq, H]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, n, -1)[:, :t]  # [B, T, N, H]
  return out.astype(query.dtype)
