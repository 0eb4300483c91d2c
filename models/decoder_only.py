"""Decoder-only (GPT-style) language model over `<bos> source <sep> target <eos>`."""

from flax import nnx

from models import stack


class DecoderOnly(nnx.Module):
  """Causal LM; the output projection is tied to the token embedding."""

  def __init__(self, cfg, vocab_size, max_length, *, rngs):
    self.decoder = stack.Stack(cfg, vocab_size, max_length, rngs=rngs)

  def __call__(self, batch, *, rngs=None):
    """Args:
      batch: dict with `inputs` `[B, T]` and optionally `segment_ids`, `positions` `[B, T]`.
      rngs: dropout randomness while training, None at evaluation.

    Returns:
      `[B, T, V]` float32 logits of the next token.
    """
    h = self.decoder(batch['inputs'], segment_ids=batch.get('segment_ids'),
                     positions=batch.get('positions'), is_causal=True, rngs=rngs)  # [B, T, D]
    return self.decoder.embed.attend(h).astype('float32')  # [B, T, V]

  def loss_terms(self, batch, *, rngs=None):
    """(logits `[B, T, V]`, targets `[B, T]`, weights `[B, T]`) for the training loss.

    `rngs` carries the `dropout` stream while training (None: deterministic evaluation).
    """
    return self(batch, rngs=rngs), batch['targets'], batch['weights']
