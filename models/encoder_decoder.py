"""Encoder-decoder Transformer: a bidirectional encoder, a causal decoder with cross-attention."""

import jax.numpy as jnp
from flax import nnx

from models import contract
from models import stack


def decoder_config(cfg):
  """`cfg` with the decoder's self-attention variant (`model.decoder_attention`, '' = the
  encoder's): an encoder variant with no causal form (Linformer) can then pair with a decoder."""
  if not cfg.get('decoder_attention'):
    return cfg
  out = cfg.copy_and_resolve_references()
  out.attention = cfg.decoder_attention
  return out


class EncoderDecoder(nnx.Module):
  """Two `models.stack.Stack`s; the output projection is tied to the decoder's token embedding
  (or an untied layer of its own: model.tie_output=False).

  The source padding reaches cross-attention through segment ids (`src_segment_ids` becomes the
  decoder's `context_segment_ids`): a target token sees only source tokens of its own segment.
  """

  spec = contract.ArchSpec(
      stacks=(contract.StackSpec('encoder', causal=False),
              contract.StackSpec('decoder', causal=True, cross_attention=True,
                                 config=decoder_config)),
      batch_format='source_target', decoder='decoder', translation='source',
      packings=('none', 'segments'), options=('share_embeddings', 'decoder_attention'))

  def __init__(self, cfg, vocab_size, max_length, *, rngs, special_ids=None):
    del special_ids  # no masking: the ids reach only the archs that mask
    self.encoder = stack.Stack(cfg, vocab_size, max_length, rngs=rngs)
    # Shared embeddings (one table for source, target and output) suit a joint vocabulary.
    embed = self.encoder.embed if cfg.get('share_embeddings', True) else None
    self.decoder = stack.Stack(decoder_config(cfg), vocab_size, max_length, cross_attention=True,
                               embed=embed, stream=1, output=True, rngs=rngs)

  def encode(self, batch, *, rngs=None):
    """`[B, S, D]` encoder output of `src_inputs` (non-causal)."""
    return self.encoder(batch['src_inputs'], segment_ids=batch.get('src_segment_ids'),
                        positions=batch.get('src_positions'), is_causal=False, rngs=rngs)

  def __call__(self, batch, *, rngs=None):
    """Args:
      batch: `src_inputs` `[B, S]`, `tgt_inputs` `[B, T]` and optionally their `*_segment_ids`
        (0 = padding) and `*_positions`.
      rngs: dropout randomness while training, None at evaluation.

    Returns:
      `[B, T, V]` float32 logits of the next target token.
    """
    return self.decoder.logits(self.features(batch, rngs=rngs))

  def features(self, batch, *, rngs=None):
    """`[B, T, D]` the decoder's final hidden states (the logits before `output_embedding()`)."""
    context = self.encode(batch, rngs=rngs)  # [B, S, D]
    return self.decoder(batch['tgt_inputs'], segment_ids=batch.get('tgt_segment_ids'),
                        positions=batch.get('tgt_positions'), is_causal=True, context=context,
                        context_segment_ids=batch.get('src_segment_ids'), rngs=rngs)

  def output_embedding(self):
    """`[V, D]` the tied output projection (models.stack.Stack.output_table)."""
    return self.decoder.output_table()

  def output_softcap(self):
    """c of the logits' soft cap c·tanh(x / c) after `output_embedding()` (0 = none)."""
    return self.decoder.final_logit_softcap

  def loss_features(self, batch, *, rngs=None):
    """`loss_terms` with the hidden states `[B, T, D]` in place of the logits (a tiled loss)."""
    return self.features(batch, rngs=rngs), batch['tgt_targets'], batch['tgt_weights']

  def loss_terms(self, batch, *, rngs=None):
    """(logits `[B, T, V]`, `tgt_targets` `[B, T]`, `tgt_weights` `[B, T]`): loss on the target."""
    return self(batch, rngs=rngs), batch['tgt_targets'], batch['tgt_weights']

  def attention_weights(self, batch):
    """Per decoder layer {'self': `[B, N, T, T]`, 'cross': `[B, N, T, S]`} (plots)."""
    context = self.encode(batch)
    return self.decoder.attention_weights(
        batch['tgt_inputs'], segment_ids=batch.get('tgt_segment_ids'),
        positions=batch.get('tgt_positions'), is_causal=True, context=context,
        context_segment_ids=batch.get('src_segment_ids'))

  # --- KV cache decoding (models.decoding) ------------------------------------------------------

  def init_cache(self, batch, max_length, dtype=jnp.float32):
    """Encodes the source once and returns the decoding cache.

    Args:
      batch: `src_inputs` `[B, S]` and optionally `src_segment_ids` (0 = padding), `src_positions`.
      max_length: target positions the self-attention cache holds.

    Returns:
      {'self': per-layer {'k', 'v'} `[B, T_max, K, H]`, 'context': per-layer cross-attention
      {'k', 'v'} `[B, S, K, H]`, 'context_mask': `[B, S]` True on real source tokens}.
    """
    context = self.encode(batch)  # [B, S, D]
    seg = batch.get('src_segment_ids')
    # Decoding holds one pair per row, segment 1, as the training rows of packing='none'.
    mask = (jnp.ones(batch['src_inputs'].shape, bool) if seg is None else seg == 1)  # [B, S]
    return {'self': self.decoder.init_cache(context.shape[0], max_length, dtype),
            'context': self.decoder.context_cache(context), 'context_mask': mask}

  def decode_step(self, cache, tokens, index):
    """Feeds target `tokens` `[B]` at positions `index`; returns (`[B, V]` logits, cache)."""
    h, self_cache = self.decoder.decode(tokens, index, cache['self'],
                                        context_cache=cache['context'],
                                        context_mask=cache['context_mask'])  # [B, D]
    return self.decoder.logits(h), {**cache, 'self': self_cache}

