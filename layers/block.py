"""The Transformer block: self-attention, optional cross-attention, feed-forward, Pre-LN or Post-LN."""

import jax.numpy as jnp
from flax import nnx

from layers import attention
from layers import attention_variants
from layers import feed_forward
from layers import norms
from layers import options

# Where the norm sits, keyed by `config.model.norm_position` (no options of their own).
NORM_POSITIONS = ('pre', 'post')


class Block(nnx.Module):
  """One layer.

  Pre-LN (Xiong et al. 2020): x + f(norm(x)); the residual path is the identity, so gradients reach
  every layer unscaled and training is stable without warmup; the stack then needs a final norm.
  Post-LN (Vaswani et al. 2017): norm(x + f(x)); the original, which at depth needs learning-rate
  warmup because the gradients near the output are large at initialisation.

  Attributes:
    collect_stats: opt-in diagnostics (False by default, so the train step computes nothing
      extra): while True, each `__call__` sows {'act_rms', and for self-attention with
      `has_scores` 'attn_max_logit', 'attn_entropy'} as `nnx.Intermediate` 'stats' (read them
      with `nnx.capture(..., nnx.Intermediate)` or `nnx.pop(model, nnx.Intermediate)`).
  """

  collect_stats = False

  def __init__(self, cfg, *, cross_attention=False, rngs):
    """Args:
      cfg: `config.model` (d_model, num_heads, num_kv_heads, d_ff, norm, norm_position, ffn,
        attention, attention_impl, dropout, use_bias, window).
      cross_attention: add a cross-attention sublayer (encoder-decoder decoders).
      rngs: parameter initialisation.
    """
    options.choice('model.norm_position', cfg.norm_position, NORM_POSITIONS)
    self.pre = cfg.norm_position == 'pre'
    make_norm = options.lookup('model.norm', norms.NORMS, cfg.norm)
    variant = options.lookup('model.attention', attention_variants.VARIANTS, cfg.attention)

    # Each variant reads its own options from `cfg`. Cross-attention stays dense, as in Longformer
    # and BigBird's encoder-decoders: the sparse patterns are defined on one sequence's positions.
    self.self_attention = variant.from_config(cfg, rngs=rngs)
    self.self_norm = make_norm(cfg.d_model, rngs=rngs)
    self.cross_attention = (attention.Attention.from_config(cfg, rngs=rngs) if cross_attention
                            else None)
    self.cross_norm = make_norm(cfg.d_model, rngs=rngs) if cross_attention else None
    self.ffn = feed_forward.make(cfg.ffn, cfg.d_model, cfg.d_ff, use_bias=cfg.use_bias, rngs=rngs)
    self.ffn_norm = make_norm(cfg.d_model, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)

  def _sublayer(self, x, norm, fn, rngs):
    if self.pre:
      return x + self.dropout(fn(norm(x)), deterministic=rngs is None, rngs=rngs)
    return norm(x + self.dropout(fn(x), deterministic=rngs is None, rngs=rngs))

  def __call__(self, x, *, segment_ids=None, positions=None, is_causal=False, position=None,
               context=None, context_segment_ids=None, rngs=None):
    """Args:
      x: `[B, T, D]`.
      segment_ids, positions: `[B, T]`.
      is_causal: causal self-attention (decoders).
      position: the `layers.positions` object, for methods acting inside attention.
      context: `[B, S, D]` encoder output for cross-attention, with `context_segment_ids` `[B, S]`.
      rngs: `nnx.Rngs` with a `dropout` stream while training, None for deterministic evaluation.

    Returns:
      `[B, T, D]`.
    """
    stats = {}

    def self_attend(h):
      if self.collect_stats and self.self_attention.has_scores:
        # The scores of this very input (after the norm under Pre-LN), from the layer itself.
        stats.update(self.self_attention.score_stats(
            h, segment_ids=segment_ids, positions=positions, is_causal=is_causal,
            position=position))
      return self.self_attention(h, segment_ids=segment_ids, positions=positions,
                                 is_causal=is_causal, position=position)

    x = self._sublayer(x, self.self_norm, self_attend, rngs)
    if self.cross_attention is not None:
      # Cross-attention carries no position term (as in T5 and ALiBi's reference): alignment is
      # learned from content, and the encoder's positions are already in its outputs.
      x = self._sublayer(x, self.cross_norm, lambda h: self.cross_attention(
          h, context, segment_ids=segment_ids, context_segment_ids=context_segment_ids), rngs)
    y = self._sublayer(x, self.ffn_norm, self.ffn, rngs)
    if self.collect_stats:
      self.sow(nnx.Intermediate, 'stats', {'act_rms': activation_rms(y, segment_ids), **stats})
    return y

  # --- KV cache path and attention maps (additive; `__call__` is unchanged) ----------------------

  def init_cache(self, batch_size, max_length, dtype):
    """This layer's self-attention cache {'k', 'v'} `[B, S_max, K, H]`."""
    return self.self_attention.init_cache(batch_size, max_length, dtype)

  def init_paged_cache(self, num_pages, page_size, dtype):
    """This layer's self-attention page pool {'k_pages', 'v_pages'} `[P, page_size, K, H]`."""
    return self.self_attention.init_paged_cache(num_pages, page_size, dtype)

  def decode(self, x, cache, index, *, position=None, context_cache=None, context_mask=None):
    """One decoding step (no dropout) of `x` `[B, 1, D]` at absolute positions `index` `[B]`.

    Args:
      x: `[B, 1, D]`.
      cache: this layer's self-attention cache (a paged one carries the 'block_table').
      index: `[B]` or scalar absolute positions.
      position: the `layers.positions` object.
      context_cache: this layer's cross-attention {'k', 'v'} of the encoder output (or None).
      context_mask: `[B, S]` True on real source tokens.

    Returns:
      (`[B, 1, D]`, the updated cache).
    """
    new = {}

    def self_attend(h):
      out, new['cache'] = self.self_attention.decode(h, cache, index, position=position)
      return out

    x = self._sublayer(x, self.self_norm, self_attend, None)
    if self.cross_attention is not None:
      x = self._sublayer(x, self.cross_norm, lambda h: self.cross_attention.decode_context(
          h, context_cache, context_mask), None)
    return self._sublayer(x, self.ffn_norm, self.ffn, None), new['cache']

  def attention_weights(self, x, *, segment_ids=None, positions=None, is_causal=False,
                        position=None, context=None, context_segment_ids=None):
    """Returns ({'self': `[B, N, T, T]`, 'cross': `[B, N, T, S]` (if any)}, the layer's output)."""
    maps = {}
    h = self.self_norm(x) if self.pre else x
    maps['self'] = self.self_attention.weights(h, segment_ids=segment_ids, positions=positions,
                                               is_causal=is_causal, position=position)
    x = self._sublayer(x, self.self_norm, lambda h: self.self_attention(
        h, segment_ids=segment_ids, positions=positions, is_causal=is_causal,
        position=position), None)
    if self.cross_attention is not None:
      h = self.cross_norm(x) if self.pre else x
      maps['cross'] = self.cross_attention.weights(h, context, segment_ids=segment_ids,
                                                   context_segment_ids=context_segment_ids)
      x = self._sublayer(x, self.cross_norm, lambda h: self.cross_attention(
          h, context, segment_ids=segment_ids, context_segment_ids=context_segment_ids), None)
    return maps, self._sublayer(x, self.ffn_norm, self.ffn, None)


def activation_rms(y, segment_ids=None):
  """The root mean square of `y` `[B, T, D]` over the real tokens (segment id > 0, or all)."""
  real = (jnp.ones(y.shape[:2], jnp.float32) if segment_ids is None
          else (segment_ids > 0).astype(jnp.float32))  # [B, T]
  count = jnp.maximum(jnp.sum(real), 1.0)
  return jnp.sqrt(jnp.sum(jnp.mean(jnp.square(y.astype(jnp.float32)), -1) * real) / count)
