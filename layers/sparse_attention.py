"""Sparse attention (sliding window, Longformer, BigBird) computed block by block:
O(T·w), never T×T.

Each query block gathers only the key blocks its pattern can reach (the band of the window,
BigBird's random blocks); global keys are one extra small key set and global query rows are
computed separately
against all keys. `layers.masks.sparse_visible` masks every gathered key, so the blocked computation
and the explicit-mask reference follow one definition of each pattern.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from layers import attention as attention_lib
from layers import attention_heads
from layers import attention_xla
from layers import masks
from layers import options

NEG = float(jnp.finfo(jnp.float32).min)


def _ceil_div(a, b):
  return -(-a // b)


def key_block_slots(pattern, num_blocks, block, is_causal):
  """numpy `[nq, slots]` key-block indices each query block gathers; -1 marks an empty slot.

  The slots are the band that `window` / `block_window` can reach, then the random blocks;
  they are a
  superset of every visible non-global key (masking makes the result exact) and never repeat a block
  (a repeated block would count its keys twice in the softmax).
  """
  rows = []
  for i in range(num_blocks):
    slots = []
    if pattern.window is not None:
      left, right = pattern.window
      right = 0 if is_causal else right
      slots += list(range(i - _ceil_div(left, block), i + _ceil_div(right, block) + 1))
    if pattern.block_window is not None:
      bw = pattern.block_window
      slots += list(range(i - bw, i + (0 if is_causal else bw) + 1))
    if pattern.random_blocks:
      slots += list(pattern.random_blocks[i])
    rows.append([j if 0 <= j < num_blocks else -1 for j in slots])
  out = np.asarray(rows, np.int32).reshape(num_blocks, -1)
  for row in out:
    used = row[row >= 0]
    assert len(set(used.tolist())) == len(used), f'repeated key block in {row}'
  return out


def bigbird_random_blocks(num_blocks, num_random, block_window, is_causal, seed):
  """Per query block, `num_random` distinct key blocks outside its local band (causal: earlier).

  Drawn from `seed` and the query block's index only, so a layer's pattern is fixed (never redrawn).
  Returns a tuple of tuples, padded with -1 where fewer blocks are available.
  """
  rows = []
  for i in range(num_blocks):
    cand = [j for j in range(num_blocks) if abs(i - j) > block_window and (not is_causal or j < i)]
    pick = np.random.default_rng([seed, i]).permutation(cand)[:num_random] if cand else []
    row = sorted(int(j) for j in pick)
    rows.append(tuple(row) + (-1,) * (num_random - len(row)))
  return tuple(rows)


def sparse_attention(query, key, value, pattern, *, scale, block, is_causal=False,
                     q_segment_ids=None, kv_segment_ids=None):
  """Self-attention restricted to `pattern`, in query blocks of `block` rows.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, T, K, H]` (self-attention: S = T), N a multiple of K.
    pattern: a `masks.SparsePattern` (its `random_blocks` use blocks of `pattern.block == block`).
    scale: score scale.
    block: rows per query block and keys per key block.
    is_causal: decoder self-attention.
    q_segment_ids, kv_segment_ids: None or `[B, T]`.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  b, t, n, h = query.shape
  s, kh = key.shape[1], key.shape[2]
  if s != t:
    raise ValueError(f'sparse attention is self-attention: T={t} and S={s} must match')
  g = n // kh
  nb = _ceil_div(t, block)
  tp = nb * block
  slots = key_block_slots(pattern, nb, block, is_causal)  # [nq, m]
  k_pos = np.where(slots[:, :, None] >= 0,
                   slots[:, :, None] * block + np.arange(block), -1).reshape(nb, -1)  # [nq, L]
  k_pos = np.where(k_pos < s, k_pos, -1)
  glob = tuple(p for p in pattern.global_tokens if p < t)
  # Global keys come from the global part below, so they are hidden wherever a block holds them.
  local_ok = (k_pos >= 0) & ~np.isin(k_pos, glob)  # [nq, L]
  gather = np.maximum(k_pos, 0)  # [nq, L]
  q_pos = np.arange(tp).reshape(nb, block)  # [nq, bq]

  pad = [(0, 0), (0, tp - t)]
  q = jnp.pad(query, pad + [(0, 0), (0, 0)]).reshape(b, nb, block, kh, g, h)  # [B, C, bq, K, G, H]
  kg = key[:, gather]  # [B, C, L, K, H]: the gathered key blocks, O(T·w) not O(T²)
  vg = value[:, gather]  # [B, C, L, K, H]
  qs = ks = None
  if q_segment_ids is not None:
    qs = jnp.pad(q_segment_ids, pad, constant_values=-1).reshape(b, nb, block)[..., None]
    ks = kv_segment_ids[:, gather][:, :, None, :]  # [B, C, 1, L]
  # Positions are static (NumPy): the pattern is built at trace time, and only the segment
  # comparison is computed in the program.
  vis = masks.sparse_visible(q_pos[:, :, None], k_pos[:, None, :], pattern, is_causal=is_causal,
                             q_seg=qs, k_seg=ks) & local_ok[:, None, :]  # [B|1, C, bq, L]
  logits = jnp.einsum('BCTKGH,BCLKH->BKGCTL', q, kg,
                      preferred_element_type=jnp.float32) * scale  # [B, K, G, C, bq, L]
  if glob:
    gk, gv = key[:, glob], value[:, glob]  # [B, J, K, H]
    g_pos = np.asarray(glob)
    gs = None if kv_segment_ids is None else kv_segment_ids[:, glob][:, None, None, :]
    vis_g = masks.sparse_visible(q_pos[:, :, None], g_pos[None, None, :], pattern,
                                 is_causal=is_causal, q_seg=qs, k_seg=gs)  # [B|1, C, bq, J]
    logits_g = jnp.einsum('BCTKGH,BJKH->BKGCTJ', q, gk,
                          preferred_element_type=jnp.float32) * scale  # [B, K, G, C, bq, J]
    logits = jnp.concatenate([logits, logits_g], -1)
    xp = np if isinstance(vis, np.ndarray) and isinstance(vis_g, np.ndarray) else jnp
    vis = xp.concatenate([vis, vis_g], -1)
  # Static masks stay NumPy up to here, so XLA has no large constant reduction to fold.
  has_key = (np if isinstance(vis, np.ndarray) else jnp).any(vis, -1, keepdims=True)
  vis = jnp.broadcast_to(vis, (b,) + vis.shape[-3:])[:, None, None]  # [B, 1, 1, C, bq, L(+J)]
  has_key = jnp.broadcast_to(has_key, (b,) + has_key.shape[-3:])[:, None, None]
  # A large finite negative, not -inf: a row with no visible key stays finite and is zeroed below.
  logits = jnp.where(vis, logits, NEG)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(has_key, probs, 0.0)
  num_local = kg.shape[2]
  out = jnp.einsum('BKGCTL,BCLKH->BCTKGH', probs[..., :num_local], vg.astype(jnp.float32))
  if glob:
    out = out + jnp.einsum('BKGCTJ,BJKH->BCTKGH', probs[..., num_local:], gv.astype(jnp.float32))
  out = out.reshape(b, tp, n, -1)[:, :t]  # [B, T, N, H]
  if glob:
    out = _global_rows(out, query, key, value, glob, pattern, scale=scale, is_causal=is_causal,
                       q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  return out.astype(query.dtype)


def _global_rows(out, query, key, value, glob, pattern, *, scale, is_causal, q_segment_ids,
                 kv_segment_ids):
  """`out` `[B, T, N, H]` with the rows of the global tokens `glob` replaced: a global query sees
  every key (subject to causality and segments), O(|G|·T), computed densely."""
  b, s = query.shape[0], key.shape[1]
  qg = query[:, glob]  # [B, J, N, H]
  qgs = None if q_segment_ids is None else q_segment_ids[:, glob][:, :, None]
  kall = None if kv_segment_ids is None else kv_segment_ids[:, None, :]
  mask = masks.sparse_visible(np.asarray(glob)[:, None], np.arange(s)[None, :], pattern,
                              is_causal=is_causal, q_seg=qgs, k_seg=kall)  # [B|1, J, S]
  mask = jnp.broadcast_to(mask, (b,) + mask.shape[-2:])[:, None]  # [B, 1, J, S]
  og = attention_xla.attention(qg, key, value, mask=mask, scale=scale)  # [B, J, N, H]
  return out.at[:, glob].set(og.astype(out.dtype))


def reference_mask(pattern, t, *, is_causal=False, segment_ids=None):
  """The explicit `[B|1, 1, T, T]` mask of `pattern` (tests, plots): O(T²), never used to train."""
  pos = np.arange(t)
  seg = (None, None) if segment_ids is None else (segment_ids[:, :, None], segment_ids[:, None, :])
  vis = masks.sparse_visible(pos[:, None], pos[None, :], pattern, is_causal=is_causal,
                             q_seg=seg[0], k_seg=seg[1])
  return vis[None, None] if vis.ndim == 2 else vis[:, None]


class _Sparse(attention_lib.Attention):
  """Shared call path: q/k/v/o projections of `Attention`, the blocked sparse kernel inside."""

  name = 'sparse'
  # The blocked kernel adds no [T, S] score terms; decoding goes through this class's `decode`,
  # which sizes the pattern from a contiguous cache.
  has_scores = False
  takes_score_terms = False
  uses_kernel = False  # its own attention computation: model.attention_impl does not apply
  layer_terms = ()  # no logit soft cap, no sinks in its own computation
  cached_decoding = 'own'  # `decode` below: the pattern's rows of the dense cached step
  has_paged_cache = False

  def pattern(self, t, is_causal):
    raise NotImplementedError

  def _scale(self, h):
    return self.scale if self.scale is not None else 1.0 / math.sqrt(h)

  def _qkv(self, x, context, positions, position, is_causal):
    if context is not None:
      raise ValueError(f'attention={self.name!r} is self-attention only (cross-attention is dense)')
    q, k, v = self.project(x)
    q, k = self.positions_without_scores(q, k, positions, position, is_causal)
    return q, k, v

  def __call__(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
               is_causal=False, positions=None, context_positions=None, position=None):
    """As `Attention.__call__` (self-attention only); `[B, T, D]` -> `[B, T, D]`."""
    q, k, v = self._qkv(x, context, positions, position, is_causal)
    out = sparse_attention(q, k, v, self.pattern(x.shape[1], is_causal),
                           scale=self._scale(q.shape[-1]),
                           block=self.block, is_causal=is_causal, q_segment_ids=segment_ids,
                           kv_segment_ids=segment_ids)  # [B, T, N, H]
    return self.output(out, x)

  def weights(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
              is_causal=False, positions=None, context_positions=None, position=None):
    """The `[B, N, T, T]` probabilities (explicit mask: for plots and tests only)."""
    q, k, _ = self._qkv(x, context, positions, position, is_causal)
    mask = reference_mask(self.pattern(x.shape[1], is_causal), x.shape[1], is_causal=is_causal,
                          segment_ids=segment_ids)
    return attention_xla.attention_weights(q, k, mask=mask, scale=self._scale(q.shape[-1]))

  def decode(self, x, cache, index, *, position=None):
    """`Attention.decode` with this variant's pattern: the new token at absolute position i sees
    the cached slots j <= i the pattern connects to i. Causal rows of every pattern here do not
    depend on the sequence length (global tokens past i are hidden by causality; BigBird's causal
    random blocks depend on the query block only), so the pattern at the cache length gives the
    full forward pass's rows exactly.
    """
    self._qkv(x, None, None, position, True)  # the same one-line errors as the forward pass
    pattern = self.pattern(cache['k'].shape[1], True)
    return self.cached_step(x, cache, index, position=position, visible=lambda q_pos, k_pos: (
        masks.sparse_visible(q_pos, k_pos, pattern, is_causal=True)))


def _common(cfg):
  return dict(use_bias=cfg.use_bias, implementation=cfg.attention_impl,
              scale=1.0 if cfg.get('unscaled', False) else None,
              **attention_heads.layer_options(cfg))


def _check_window(m):
  if not isinstance(m.window, int) or isinstance(m.window, bool) or m.window < 0:
    raise options.ConfigError(f'model.window={m.window!r} must be an integer >= 0')


def _check_global_tokens(m, length):
  glob = tuple(m.global_tokens)
  if any(not isinstance(p, int) or p < 0 for p in glob):
    raise options.ConfigError(f'model.global_tokens={glob!r} must be positions >= 0')
  if len(set(glob)) > length or any(p >= length for p in glob):
    raise options.ConfigError(f'model.global_tokens={glob!r} must be fewer than data.max_length='
                              f'{length} positions, each < {length}')


class SlidingWindowAttention(_Sparse):
  """Each token sees keys within `window` positions: |i - j| <= w (encoder), i - w <= j <= i
  (decoder).

  `local_window_size` is set too: the dense scores under that window are this layer's scores, so
  it has `score_stats` (has_scores) although its kernel is the blocked one.
  """

  name = 'sliding_window'
  has_scores = True
  options = attention_lib.Attention.options + ('window',)

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, window, block=None, **kwargs):
    super().__init__(d_model, num_heads, num_kv_heads, local_window_size=int(window), **kwargs)
    self.window = int(window)
    # Blocks about as wide as the window: each query block gathers ~3 key blocks (~3w keys).
    self.block = block or max(16, min(self.window, 512))

  @classmethod
  def from_config(cls, cfg, *, rngs):
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, window=cfg.window, rngs=rngs,
               **_common(cfg))

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    super().check_config(model_cfg, data_cfg)
    _check_window(model_cfg)

  def pattern(self, t, is_causal):
    return masks.SparsePattern(window=(self.window, self.window))


class LongformerAttention(_Sparse):
  """Sliding window plus global tokens that see every position and are seen by every position."""

  name = 'longformer'
  options = attention_lib.Attention.options + ('window', 'global_tokens')

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, window, global_tokens=(0,),
               block=None, **kwargs):
    super().__init__(d_model, num_heads, num_kv_heads, **kwargs)
    self.window = int(window)
    self.global_tokens = tuple(sorted({int(p) for p in global_tokens}))
    self.block = block or max(16, min(self.window, 512))

  @classmethod
  def from_config(cls, cfg, *, rngs):
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, window=cfg.window,
               global_tokens=tuple(cfg.global_tokens), rngs=rngs, **_common(cfg))

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    super().check_config(model_cfg, data_cfg)
    _check_window(model_cfg)
    _check_global_tokens(model_cfg, data_cfg.max_length)

  def pattern(self, t, is_causal):
    return masks.SparsePattern(window=(self.window, self.window),
                               global_tokens=tuple(p for p in self.global_tokens if p < t))


class BigBirdAttention(_Sparse):
  """BigBird (Zaheer et al. 2020): block-local (own and neighbouring blocks) + global +
  random blocks.

  The random blocks are drawn from `seed` per query block (and the length and causality), so they
  are fixed for the layer, never redrawn.
  """

  name = 'bigbird'
  # Each layer draws its random blocks from its own `attention_seed` (models/stack.py gives every
  # layer one), which one trace shared by scanned layers cannot do.
  scannable = False
  options = attention_lib.Attention.options + ('bigbird_block', 'bigbird_random_blocks',
                                               'global_tokens', 'attention_seed')

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, block=16, num_random=2,
               global_tokens=(0,), seed=0, **kwargs):
    super().__init__(d_model, num_heads, num_kv_heads, **kwargs)
    self.block, self.num_random, self.seed = int(block), int(num_random), int(seed)
    self.global_tokens = tuple(sorted({int(p) for p in global_tokens}))

  @classmethod
  def from_config(cls, cfg, *, rngs):
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, block=cfg.bigbird_block,
               num_random=cfg.bigbird_random_blocks, global_tokens=tuple(cfg.global_tokens),
               seed=cfg.attention_seed, rngs=rngs, **_common(cfg))

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    super().check_config(model_cfg, data_cfg)
    m = model_cfg
    _check_global_tokens(m, data_cfg.max_length)
    if not isinstance(m.bigbird_block, int) or m.bigbird_block <= 0:
      raise options.ConfigError(f'model.bigbird_block={m.bigbird_block!r} must be a positive '
                                'integer')
    if not isinstance(m.bigbird_random_blocks, int) or m.bigbird_random_blocks < 0:
      raise options.ConfigError(f'model.bigbird_random_blocks={m.bigbird_random_blocks!r} must be '
                                'an integer >= 0')

  def pattern(self, t, is_causal):
    nb = _ceil_div(t, self.block)
    rand = (bigbird_random_blocks(nb, self.num_random, 1, is_causal, self.seed)
            if self.num_random else ())
    return masks.SparsePattern(block=self.block, block_window=1, random_blocks=rand,
                               global_tokens=tuple(p for p in self.global_tokens if p < t))

