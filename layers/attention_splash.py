"""jax's TPU splash attention (block-sparse flash attention in Mosaic) behind the kernel contract.

`jax.experimental.pallas.ops.tpu.splash_attention` takes its visibility as a static mask object
(FullMask, CausalMask, LocalMask for a window): the host works out which (query block, key block)
pairs the mask leaves empty, and the forward, dK/dV and dQ kernels skip them. Segment ids are
compared inside the kernel (they skip nothing). It evaluates the logit soft cap and attention sinks
itself; it takes no added terms (ALiBi, a bias or mask array, a bias function) and no dropout.

Its layout is per batch row, `[N, T, H]` against `[K, S, H]` (N a multiple of K: GQA and MQA in its
MHA form, each query head reading its group's key/value head, nothing repeated), so the batch is
vmapped. It does not scale the scores: q is multiplied by `scale` before the call. The lengths are
padded to whole 128-blocks; padded keys get a segment id no real query has. Its calls carry cost
estimates of the blocks they compute (`attention_splash_cost`), so XLA's cost analysis counts them.
"""

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from layers import attention_pallas_host as host
from layers import attention_splash_cost
from layers import flash_core

# splash's default tiles (BlockSizes.get_default) for the forward, dK/dV and dQ kernels: multiples
# of 128 lanes; the lengths are padded to them.
BLOCK = 128
# The segment id of padded keys (and queries): below every real id.
_PAD_ID = jnp.iinfo(jnp.int32).min


def _mask(t, s, n, is_causal, window):
  """splash's static mask of N heads over `[T, S]`: the band the kernels visit."""
  if window is not None:
    left, right = window
    one = splash.LocalMask((t, s), (left, min(right, 0) if is_causal else right), offset=0)
  elif is_causal:
    one = splash.CausalMask((t, s))
  else:
    one = splash.FullMask((t, s))
  return splash.MultiHeadMask([one] * n)


def _kernel(mask, softcap, interpret):
  """The splash kernel of the MultiHeadMask `mask`. Built inside the trace: its block masks become
  constants of the program (splash keeps the host's work on them in a cache of its own,
  `splash_attention_mask_info._process_mask`)."""
  blocks = splash.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK,
                             block_q_dkv=BLOCK, block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK,
                             block_q_dq=BLOCK, block_kv_dq=BLOCK)
  return splash.make_splash_mha(mask, block_sizes=blocks,
                                head_shards=1, q_seq_shards=1, attn_logits_soft_cap=softcap,
                                interpret=interpret)


def _segments(q_segment_ids, kv_segment_ids, b, t, s, tp, sp):
  """splash's SegmentIds (`[B, Tp]`, `[B, Sp]`), or None when neither ids nor key padding need
  them; padded positions get `_PAD_ID`, which no real query has."""
  if q_segment_ids is None:
    if sp == s:
      return None  # padded queries see real keys; their rows are dropped
    q_segment_ids = jnp.zeros((b, t), jnp.int32)
    kv_segment_ids = jnp.zeros((b, s), jnp.int32)
  q_seg = flash_core.pad_axis(q_segment_ids.astype(jnp.int32), 1, tp, _PAD_ID)  # [B, Tp]
  kv_seg = flash_core.pad_axis(kv_segment_ids.astype(jnp.int32), 1, sp, _PAD_ID)  # [B, Sp]
  return splash.SegmentIds(q=q_seg, kv=kv_seg)


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
              sinks=None, interpret=False):
  """Splash attention; the arguments are those of `attention_blockwise.attention` less what it
  does not take (bias, mask and alibi_slopes must be None).

  Args:
    query: `[B, T, N, H]`; key, value: `[B, S, K, H]`, N a multiple of K.
    scale, is_causal, window, q_segment_ids, kv_segment_ids, softcap, sinks: as in
      `layers.attention.dot_product_attention` (window already normalised to (left, right)).
    interpret: run in Pallas's TPU interpret mode (on any backend; the numerics tests on CPU).

  Returns:
    `[B, T, N, H]` in the query's dtype. A row with no visible key (none under causal self-attention
    with segment ids) is zeros with sinks; without them it is splash's, not defined here.
  """
  if bias is not None or mask is not None or alibi_slopes is not None:
    raise ValueError('splash attention takes no bias, mask or ALiBi slopes')
  b, t, n, _ = query.shape
  s = key.shape[1]
  tp, sp = host.round_up(t, BLOCK), host.round_up(s, BLOCK)
  segments = _segments(q_segment_ids, kv_segment_ids, b, t, s, tp, sp)
  # [B, N, Tp, H] and [B, K, Sp, H]: splash's head-major layout; its scores are q·k unscaled.
  q = flash_core.pad_axis((query * scale).astype(query.dtype), 1, tp).transpose(0, 2, 1, 3)
  k = flash_core.pad_axis(key, 1, sp).transpose(0, 2, 1, 3)
  v = flash_core.pad_axis(value, 1, sp).transpose(0, 2, 1, 3)
  window = None if window is None else tuple(window)
  mask = _mask(tp, sp, n, bool(is_causal), window)
  softcap = float(softcap) if softcap else None
  # XLA's cost analysis counts splash's calls by these (it passes none of its own).
  costs = attention_splash_cost.estimates(mask, BLOCK, kv_heads=k.shape[1], head_dim=q.shape[3],
                                          itemsize=q.dtype.itemsize, softcap=bool(softcap))
  in_axes = (0, 0, 0, None if segments is None else 0, None)

  def rows(*args):  # the kernel built here, inside whichever trace calls it
    return jax.vmap(_kernel(mask, softcap, bool(interpret)), in_axes=in_axes)(*args)

  sinks = None if sinks is None else sinks.astype(jnp.float32)
  out = attention_splash_cost.with_costs(rows, costs)(q, k, v, segments, sinks)  # [B, N, Tp, H]
  return out[:, :, :t].transpose(0, 2, 1, 3).astype(query.dtype)  # [B, T, N, H]
