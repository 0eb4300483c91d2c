"""Decoder-only (GPT-style) language model over `<bos> source <sep> target <eos>`."""

import jax
import jax.numpy as jnp
from flax import nnx

from layers import paged_attention
from models import contract
from models import stack


class DecoderOnly(nnx.Module):
  """Causal LM; the output projection is tied to the token embedding (or untied: tie_output)."""

  spec = contract.ArchSpec(
      stacks=(contract.StackSpec('decoder', causal=True),), batch_format='next_token',
      decoder='decoder', translation='prompt', documents=True, causal_lm=True)

  def __init__(self, cfg, vocab_size, max_length, *, rngs, special_ids=None):
    del special_ids  # no masking: the ids reach only the archs that mask
    self.decoder = stack.Stack(cfg, vocab_size, max_length, output=True, rngs=rngs)

  def __call__(self, batch, *, rngs=None):
    """Args:
      batch: dict with `inputs` `[B, T]` and optionally `segment_ids`, `positions` `[B, T]`.
      rngs: dropout randomness while training, None at evaluation.

    Returns:
      `[B, T, V]` float32 logits of the next token.
    """
    return self.decoder.logits(self.features(batch, rngs=rngs))  # [B, T, V]

  def features(self, batch, *, rngs=None):
    """`[B, T, D]` the final hidden states, whose product with `output_embedding()` is
    the logits (before the soft cap, `output_softcap()`)."""
    return self.decoder(batch['inputs'], segment_ids=batch.get('segment_ids'),
                        positions=batch.get('positions'), is_causal=True, rngs=rngs)

  def output_embedding(self):
    """`[V, D]` the tied output projection (models.stack.Stack.output_table)."""
    return self.decoder.output_table()

  def output_softcap(self):
    """c of the logits' soft cap c·tanh(x / c) after `output_embedding()` (0 = none)."""
    return self.decoder.final_logit_softcap

  def loss_features(self, batch, *, rngs=None):
    """`loss_terms` with the hidden states `[B, T, D]` in place of the logits (a tiled loss)."""
    return self.features(batch, rngs=rngs), batch['targets'], batch['weights']

  def loss_terms(self, batch, *, rngs=None):
    """(logits `[B, T, V]`, targets `[B, T]`, weights `[B, T]`) for the training loss.

    `rngs` carries the `dropout` stream while training (None: deterministic evaluation).
    """
    return self(batch, rngs=rngs), batch['targets'], batch['weights']

  def attention_weights(self, batch):
    """Per layer {'self': `[B, N, T, T]`} (plots)."""
    return self.decoder.attention_weights(batch['inputs'], segment_ids=batch.get('segment_ids'),
                                          positions=batch.get('positions'), is_causal=True)

  # --- KV cache decoding (models.decoding) ------------------------------------------------------

  def init_cache(self, batch, max_length, dtype=jnp.float32, *, page_size=None, num_pages=None):
    """An empty cache for `max_length` positions; `batch` is any dict of `[B, ...]` arrays.

    With `page_size`, a paged cache (layers.paged_attention): `num_pages` pages (default: enough
    for every row at `max_length`) shared by the rows, and a block table of null pages that the
    caller fills from a `PageAllocator` before each step.

    Returns:
      {'self': per-layer {'k', 'v'} `[B, S_max, K, H]`}, or paged {'self': per-layer
      {'k_pages', 'v_pages'} `[P, page_size, K, H]`, 'block_table': `[B, max_pages]` int32}.
    """
    b = jax.tree.leaves(batch)[0].shape[0]
    cache = {'self': self.decoder.init_cache(b, max_length, dtype, page_size=page_size,
                                             num_pages=num_pages)}
    if page_size is not None:
      cache['block_table'] = jnp.zeros(
          (b, paged_attention.pages_for(max_length, page_size)), jnp.int32)  # the null page
    return cache

  def decode_step(self, cache, tokens, index):
    """Feeds `tokens` `[B]` at positions `index`; returns (`[B, V]` next-token logits, cache)."""
    h, self_cache = self.decoder.decode(tokens, index, cache['self'],
                                        block_table=cache.get('block_table'))  # [B, D]
    return self.decoder.logits(h), {**cache, 'self': self_cache}
