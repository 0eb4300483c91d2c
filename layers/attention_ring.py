"""Ring attention (context parallelism): queries stay put, key/value blocks travel round the
`sequence` ring.

The length axis of q/k/v is split over the mesh axis `sequence` (P devices). Each device keeps its
`T/P` queries and, in P steps, sees every `S/P` key/value block as the blocks are passed one device
along the ring with `lax.ppermute`, folding each into a FlashAttention-2 online softmax
(running max,
denominator and un-normalised output, float32). Positions are absolute (device index x block
length), so causality, the local window and ALiBi mean what they mean on the whole sequence, and a
block that they hide entirely is not computed. A `jax.custom_vjp` saves only the output and the
per-row logsumexp; the backward pass sends the key/value blocks round the ring again, recomputes
each block's probabilities, and carries the block's dK/dV with it, so that after P steps they are
back on the block's owner. No device ever holds more than one `[T/P, S/P]` score block per head.
(Liu et al. 2023, "Ring Attention with Blockwise Transformers".)
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from layers import flash_core

# Mesh axes of the activations, as in the default rules of `config.mesh` (batch -> data x fsdp x
# expert, length -> sequence, heads -> tensor). A dimension that an axis does not divide stays
# replicated.
BATCH_AXES = ('data', 'fsdp', 'expert')
LENGTH_AXIS = 'sequence'
HEAD_AXIS = 'tensor'


class RingConfig(NamedTuple):
  """Static (hashable) settings of one ring call."""
  mesh: jax.sharding.AbstractMesh
  ring: int  # P, the size of the `sequence` axis
  batch: tuple  # mesh axes splitting B (may be empty)
  heads: str | None  # mesh axis splitting N and K, or None
  scale: float
  is_causal: bool
  window: tuple | None
  kv_len: int  # S before padding to a multiple of P
  softcap: float = 0.0  # c > 0: logits c·tanh(logits / c) (flash_core.tile_logits); 0 = none


def _live(cfg, q_first, q_len, k_first, k_len):
  """Whether a `[q_len, k_len]` block at these absolute offsets may hold a visible pair (scalar).

  Causality and the window give a band of the whole matrix; a block outside it is skipped, and
  its ppermute still runs, since every device of the ring must take part in every transfer.
  """
  q_last, k_last = q_first + q_len - 1, k_first + k_len - 1
  live = k_first < cfg.kv_len
  if cfg.is_causal:
    live &= k_first <= q_last
  if cfg.window is not None:
    left, right = cfg.window
    live &= (k_last >= q_first - left) & (k_first <= q_last + right)
  return live


def _logits(cfg, q, k, q_pos, k_pos, slopes, q_seg, kv_seg):
  """Scaled scores of the local queries against one key block, -inf where hidden.

  Args:
    q: `[b, K, G, t, H]`; k: `[b, K, s, H]`.
    q_pos, k_pos: `[t]`, `[s]` absolute positions.
    slopes: None or this device's `[n]` float32 ALiBi slopes (n = K * G).
    q_seg, kv_seg: None or `[b, t]`, `[b, s]`.

  Returns:
    `[b, K, G, t, s]` float32.
  """
  kh, g = q.shape[1:3]
  qk = jnp.einsum('BKGTH,BKSH->BKGTS', q, k, preferred_element_type=jnp.float32)
  # From absolute positions: a block's ALiBi distance and visibility are the whole sequence's.
  return flash_core.tile_logits(
      qk, q_pos[:, None], k_pos[None], scale=cfg.scale, is_causal=cfg.is_causal, window=cfg.window,
      softcap=cfg.softcap,
      kv_len=cfg.kv_len if cfg.kv_len % cfg.ring else None,  # keys past S pad the last block
      slope=None if slopes is None else slopes.reshape(kh, g, 1, 1),
      q_seg=None if q_seg is None else q_seg[:, None, None, :, None],  # [b, 1, 1, t, 1]
      k_seg=None if kv_seg is None else kv_seg[:, None, None, None, :])  # [b, 1, 1, 1, s]


def _rotate(cfg, x):
  """Sends `x` (a pytree) one device along the ring: device i receives from device i - 1."""
  perm = [(i, (i + 1) % cfg.ring) for i in range(cfg.ring)]
  return lax.ppermute(x, LENGTH_AXIS, perm)


def _split_heads(q, k, v):
  """`[b, t, n, H]`, `[b, s, K, H]` x2 -> `[b, K, G, t, H]`, `[b, K, s, H]` x2 (blocks per head)."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  q = q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4)
  return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _forward_local(cfg, q, k, v, extra):
  """One device's share of the forward pass (inside `shard_map`).

  Args:
    q: `[b, t, n, H]` local queries; k, v: `[b, s, K, H]` this device's key/value block.
    extra: dict with optional 'slopes' `[n]`, 'q_seg' `[b, t]`, 'kv_seg' `[b, s]`, 'sinks' `[n]`.

  Returns:
    out `[b, t, n, H]` float32 and logsumexp `[b, t, n]` (+inf on rows with no visible key).
  """
  b, t, n, _ = q.shape
  s = k.shape[1]
  qb, kb, vb = _split_heads(q, k, v)
  me = lax.axis_index(LENGTH_AXIS)
  q_pos = me * t + jnp.arange(t)  # [t]
  slopes, q_seg = extra.get('slopes'), extra.get('q_seg')

  def update(r, state, block):
    kb, vb, kv_seg = block
    # After r rotations this device holds the block of device me - r.
    k_first = ((me - r) % cfg.ring) * s
    k_pos = k_first + jnp.arange(s)  # [s]

    def compute(state):
      logits = _logits(cfg, qb, kb, q_pos, k_pos, slopes, q_seg, kv_seg)  # [b, K, G, t, s]
      return flash_core.online_update(state, logits, vb)

    return lax.cond(_live(cfg, me * t, t, k_first, s), compute, lambda st: st, state)

  def step(r, carry):
    state, block = carry
    # Issued before the compute, which does not depend on it: the transfer can overlap the math.
    nxt = _rotate(cfg, block)
    return update(r, state, block), nxt

  # Derived from q so that the loop state varies over the mesh axes exactly as the updates do.
  zero = jnp.zeros_like(qb, jnp.float32)  # [b, K, G, t, H]
  init = (zero[..., 0] - jnp.inf, zero[..., 0], zero)
  block = (kb, vb, extra.get('kv_seg'))
  state, block = lax.fori_loop(0, cfg.ring - 1, step, (init, block))
  sinks = extra.get('sinks')
  sink = None if sinks is None else sinks.reshape(qb.shape[1], qb.shape[2], 1)  # [K, G, 1]
  # [b, K, G, t, H] (zeros on rows that saw no key), [b, K, G, t]
  out, lse = flash_core.finalize(update(cfg.ring - 1, state, block), sink)
  out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, -1)
  return out, lse.transpose(0, 3, 1, 2).reshape(b, t, n)


def _backward_local(cfg, q, k, v, extra, out, lse, d_out):
  """One device's share of the FlashAttention-2 backward pass (inside `shard_map`).

  Queries, their output, logsumexp and output cotangent stay here; each key/value block goes
  round the ring once more, together with the dK/dV that every device adds to as it passes.

  Returns:
    dq `[b, t, n, H]`, dk and dv `[b, s, K, H]`, in the inputs' dtypes.
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  qb, kb, vb = _split_heads(q, k, v)
  me = lax.axis_index(LENGTH_AXIS)
  q_pos = me * t + jnp.arange(t)  # [t]
  slopes, q_seg = extra.get('slopes'), extra.get('q_seg')
  to_blocks = lambda x: x.reshape(b, t, kh, g, -1).transpose(0, 2, 3, 1, 4)  # -> [b, K, G, t, .]
  delta = flash_core.backward_delta(to_blocks(out), to_blocks(d_out))  # [b, K, G, t]
  lse = to_blocks(lse[..., None])[..., 0]  # [b, K, G, t]
  do = to_blocks(d_out.astype(q.dtype))  # [b, K, G, t, H]

  def update(r, dq, block, grads):
    kb, vb, kv_seg = block
    k_first = ((me - r) % cfg.ring) * s
    k_pos = k_first + jnp.arange(s)  # [s]

    def compute(args):
      dq, (dk, dv) = args
      logits = _logits(cfg, qb, kb, q_pos, k_pos, slopes, q_seg, kv_seg)  # [b, K, G, t, s]
      # The forward's probabilities, recomputed: dK, dV `[b, K, s, H]` sum the G query heads.
      grads = flash_core.tile_grads(logits, lse, delta, qb, kb, vb, do, softcap=cfg.softcap,
                                    scale=cfg.scale)
      return dq + grads.dq, (dk + grads.dk, dv + grads.dv)

    return lax.cond(_live(cfg, me * t, t, k_first, s), compute, lambda a: a, (dq, grads))

  def step(r, carry):
    dq, block, grads = carry
    nxt = _rotate(cfg, block)  # overlaps the compute; the gradients must wait for it
    dq, grads = update(r, dq, block, grads)
    return dq, nxt, _rotate(cfg, grads)

  dq = jnp.zeros_like(qb, jnp.float32)
  grads = (jnp.zeros_like(kb, jnp.float32), jnp.zeros_like(vb, jnp.float32))  # [b, K, s, H] x2
  block = (kb, vb, extra.get('kv_seg'))
  dq, block, grads = lax.fori_loop(0, cfg.ring - 1, step, (dq, block, grads))
  dq, grads = update(cfg.ring - 1, dq, block, grads)
  # The P-th rotation brings each block's gradients home to the device that owns the block.
  dk, dv = _rotate(cfg, grads)
  dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
  return (dq.astype(q.dtype), dk.transpose(0, 2, 1, 3).astype(k.dtype),
          dv.transpose(0, 2, 1, 3).astype(v.dtype))


def _specs(cfg, extra):
  """`PartitionSpec`s of q/out `[B, T, N, H]`, k/v `[B, S, K, H]`, lse `[B, T, N]` and `extra`."""
  batch = cfg.batch if cfg.batch else None
  x = P(batch, LENGTH_AXIS, cfg.heads, None)
  extra_specs = {'slopes': P(cfg.heads), 'q_seg': P(batch, LENGTH_AXIS),
                 'kv_seg': P(batch, LENGTH_AXIS), 'sinks': P(cfg.heads)}
  return x, P(batch, LENGTH_AXIS, cfg.heads), {name: extra_specs[name] for name in extra}


def _shard_map(cfg, f, in_specs, out_specs):
  # The mesh is passed, not read from the context: the backward pass may be traced after the
  # caller's `with jax.set_mesh(...)` has exited.
  return jax.shard_map(functools.partial(f, cfg), mesh=cfg.mesh, in_specs=in_specs,
                       out_specs=out_specs)


def _ring_forward(cfg, q, k, v, extra):
  x, row, ex = _specs(cfg, extra)
  return _shard_map(cfg, _forward_local, (x, x, x, ex), (x, row))(q, k, v, extra)


def _ring_backward(cfg, args, out, lse, d_out):
  q, k, v, extra = args
  x, row, ex = _specs(cfg, extra)
  dq, dk, dv = _shard_map(cfg, _backward_local, (x, x, x, ex, x, row, x), (x, x, x))(
      q, k, v, extra, out, lse, d_out)
  # Segment ids and ALiBi slopes are not differentiated (ALiBi slopes are fixed); the sinks'
  # gradient needs only each row's lse and delta, summed over the batch and the length by GSPMD.
  d_extra = jax.tree.map(lambda _: None, extra)
  if 'sinks' in extra:
    delta = flash_core.backward_delta(out, d_out)  # [B, Tp, N]
    d_extra['sinks'] = flash_core.sink_grad(extra['sinks'], lse, delta, (0, 1))  # [N]
  return dq, dk, dv, d_extra


# Residuals are O(T) per device: the inputs, the output and one logsumexp per row.
_ring = flash_core.flash_vjp(_ring_forward, _ring_backward)


def _reshard(x, spec, mesh):
  """Under explicit mesh axes, the array's type carries its sharding: move it to `spec` first."""
  if any(t == AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(x, spec)
  return x


def ring_attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
                   alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
                   sinks=None):
  """Exact attention with the length split over the ambient mesh's `sequence` axis.

  Call it under a mesh (`with jax.set_mesh(mesh):`) with axes `data`, `fsdp`, `tensor`,
  `sequence`, `expert`; the arguments are those of `attention_xla.attention`.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, S, K, H]`, N a multiple of K (query head n reads key/value head n // G).
    bias, mask: must be None: a dense `[B, N, T, S]` array is what ring attention avoids.
    scale, is_causal, window, alibi_slopes, q_segment_ids, kv_segment_ids: see `attention_xla`;
      positions are absolute over the whole sequence, as there.
    softcap, sinks: the logit soft cap and the `[N]` sink logits, as in `attention_blockwise`.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.

  Raises:
    ValueError: a dense bias/mask, or no `sequence` mesh axis larger than 1.
  """
  if bias is not None or mask is not None:
    raise ValueError("implementation='ring' takes no dense bias/mask array (it would be "
                     '[B, N, T, S] on every device): use is_causal, local_window_size, '
                     'alibi_slopes, segment_ids')
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(zip(mesh.axis_names, mesh.axis_sizes))
  ring = sizes.get(LENGTH_AXIS, 1)
  if ring <= 1:
    raise ValueError("implementation='ring' needs config.mesh.sequence > 1 (a mesh with a "
                     f"'sequence' axis > 1 set by jax.set_mesh); the mesh in context is {sizes}")
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]

  # Batch and heads are split where the axes divide them and replicated otherwise; heads only if
  # both N and K divide, so that every query head finds its key/value head on the same device.
  batch = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
  if b % math.prod(sizes[a] for a in batch):
    batch = ()
  tp = sizes.get(HEAD_AXIS, 1)
  heads = HEAD_AXIS if tp > 1 and n % tp == 0 and kh % tp == 0 else None
  cfg = RingConfig(mesh, ring, batch, heads, float(scale), bool(is_causal),
                   None if window is None else tuple(window), s, float(softcap or 0.0))

  # The length is padded to a multiple of P: padded keys are hidden (`kv_len`), padded query rows
  # are dropped from the output.
  tp_len, sp_len = -(-t // ring) * ring, -(-s // ring) * ring
  extra = {}
  pad = lambda x, size: flash_core.pad_axis(x, 1, size)
  if alibi_slopes is not None:
    extra['slopes'] = lax.stop_gradient(alibi_slopes).astype(jnp.float32)
  if sinks is not None:
    extra['sinks'] = sinks.astype(jnp.float32)
  if q_segment_ids is not None:
    extra['q_seg'] = pad(q_segment_ids, tp_len)
    extra['kv_seg'] = pad(kv_segment_ids, sp_len)
  x_spec, _, extra_specs = _specs(cfg, extra)
  q = _reshard(pad(query, tp_len), x_spec, mesh)
  k = _reshard(pad(key, sp_len), x_spec, mesh)
  v = _reshard(pad(value, sp_len), x_spec, mesh)
  extra = {name: _reshard(a, extra_specs[name], mesh) for name, a in extra.items()}
  out = _ring(cfg, q, k, v, extra)  # [B, Tp, N, H]
  explicit = any(a == AxisType.Explicit for a in mesh.axis_types)
  if tp_len != t:
    if explicit:
      # Explicit sharding refuses a slice of the split length axis that the ring does not divide.
      out = jax.sharding.reshard(out, P(*x_spec[:1], None, *x_spec[2:]))
    out = out[:, :t]  # [B, T, N, H]
  if explicit:
    # Back to the query's own sharding, so that the caller's types do not change.
    out = jax.sharding.reshard(out, jax.typeof(query).sharding.spec)
  return out.astype(query.dtype)
