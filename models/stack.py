"""A stack of Transformer blocks over token embeddings: the body of every Transformer model."""

import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import block
from layers import norms
from layers import paged_attention
from layers import sharding
from layers import positions as positions_lib


def layer_config(cfg, stream, layer):
  """`cfg` with the attention seed of layer `layer` of stack `stream`: random draws differ across
  layers and stacks, and stay a function of `model.attention_seed`."""
  if 'attention_seed' not in cfg:
    return cfg
  out = cfg.copy_and_resolve_references()
  out.attention_seed = int(np.random.SeedSequence([cfg.attention_seed, stream, layer])
                           .generate_state(1)[0])
  return out


class Stack(nnx.Module):
  """Embeds tokens, adds positions, runs `num_layers` blocks and (Pre-LN) a final norm."""

  def __init__(self, cfg, vocab_size, max_length, *, cross_attention=False, embed=None, stream=0,
               rngs):
    """Args:
      cfg: `config.model`.
      vocab_size: V.
      max_length: longest sequence the position method must represent (learned tables).
      cross_attention: blocks attend to a context (encoder-decoder decoder).
      embed: an `nnx.Embed` to share (tied encoder/decoder embeddings), or None for a new one.
      stream: which stack of the model this is (0, 1, ...): with the layer index it gives every
        layer its own `attention_seed` (BigBird's random blocks, the Performer's features).
      rngs: parameter initialisation.
    """
    self.d_model = cfg.d_model
    # Unit-variance rows after the sqrt(D) scale below, so token and position signals are comparable.
    self.embed = embed if embed is not None else nnx.Embed(
        vocab_size, cfg.d_model, rngs=rngs,
        embedding_init=sharding.partitioned(
            nnx.initializers.normal(stddev=1.0 / math.sqrt(cfg.d_model)), 'vocab', 'embed'))
    self.position = positions_lib.make(cfg, max_length, rngs=rngs)
    self.blocks = nnx.List([
        block.Block(layer_config(cfg, stream, i), cross_attention=cross_attention, rngs=rngs)
        for i in range(cfg.num_layers)])
    self.final_norm = (norms.NORMS[cfg.norm](cfg.d_model, rngs=rngs)
                       if cfg.norm_position == 'pre' else None)
    self.dropout = nnx.Dropout(cfg.dropout)

  def __call__(self, tokens, *, segment_ids=None, positions=None, is_causal=False, context=None,
               context_segment_ids=None, rngs=None):
    """Args:
      tokens: `[B, T]` int.
      segment_ids: `[B, T]` (0 = padding) or None.
      positions: `[B, T]` or None for 0..T-1.
      is_causal, context, context_segment_ids, rngs: see `layers.block.Block`.

    Returns:
      `[B, T, D]` hidden states.
    """
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [B, T]
    x = self.embed(tokens) * math.sqrt(self.d_model)  # [B, T, D]
    x = self.position.embed(x, positions)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    names = ('batch', 'length', 'act_embed')  # the residual stream (layers.sharding)
    x = sharding.constrain(x, names)
    for layer in self.blocks:
      x = sharding.constrain(layer(
          x, segment_ids=segment_ids, positions=positions, is_causal=is_causal,
          position=self.position, context=context, context_segment_ids=context_segment_ids,
          rngs=rngs), names)
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x

  # --- KV cache path and attention maps (additive; `__call__` is unchanged) ----------------------

  def init_cache(self, batch_size, max_length, dtype=jnp.float32, *, page_size=None,
                 num_pages=None):
    """Per-layer self-attention caches: a list of {'k', 'v'} `[B, S_max, K, H]`, or with
    `page_size` a list of page pools {'k_pages', 'v_pages'} `[P, page_size, K, H]`
    (layers.paged_attention; P = `num_pages`, default enough for every row at `max_length`).

    Raises ValueError if the position method cannot represent `max_length` positions.
    """
    self.position.check_length(max_length)
    if page_size is None:
      return [layer.init_cache(batch_size, max_length, dtype) for layer in self.blocks]
    if num_pages is None:
      num_pages = paged_attention.default_num_pages(batch_size, max_length, page_size)
    return [layer.init_paged_cache(num_pages, page_size, dtype) for layer in self.blocks]

  def context_cache(self, context):
    """Per-layer cross-attention keys/values of an encoder output `[B, S, D]` (computed once)."""
    return [layer.cross_attention.context_cache(context) for layer in self.blocks]

  def decode(self, tokens, index, cache, *, context_cache=None, context_mask=None,
             block_table=None):
    """One causal decoding step.

    Args:
      tokens: `[B]` int, each row's token at absolute position `index`.
      index: `[B]` or scalar int.
      cache: from `init_cache`.
      context_cache, context_mask: from `context_cache` and `[B, S]` (encoder-decoder).
      block_table: `[B, max_pages]` int32 for a paged cache (one table for every layer's pool).

    Returns:
      (`[B, D]` hidden state, the updated cache).
    """
    b = tokens.shape[0]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))  # [B]
    x = self.embed(tokens[:, None]) * math.sqrt(self.d_model)  # [B, 1, D]
    x = self.position.embed(x, index[:, None])
    new_cache = []
    for i, layer in enumerate(self.blocks):
      # Each layer sees its own pool with the shared table; only the pools come back.
      layer_cache = cache[i] if block_table is None else {**cache[i], 'block_table': block_table}
      x, c = layer.decode(x, layer_cache, index, position=self.position,
                          context_cache=None if context_cache is None else context_cache[i],
                          context_mask=context_mask)
      new_cache.append(c if block_table is None else
                       {k: a for k, a in c.items() if k != 'block_table'})
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x[:, 0], new_cache

  def attention_weights(self, tokens, *, segment_ids=None, positions=None, is_causal=False,
                        context=None, context_segment_ids=None):
    """Each layer's attention probabilities: a list of {'self': `[B, N, T, T]`, 'cross': ...}."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [B, T]
    x = self.embed(tokens) * math.sqrt(self.d_model)  # [B, T, D]
    x = self.position.embed(x, positions)
    maps = []
    for layer in self.blocks:
      m, x = layer.attention_weights(x, segment_ids=segment_ids, positions=positions,
                                     is_causal=is_causal, position=self.position, context=context,
                                     context_segment_ids=context_segment_ids)
      maps.append(m)
    return maps
