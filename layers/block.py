"""The Transformer block: self-attention, optional cross-attention, feed-forward, Pre-LN or Post-LN."""

from flax import nnx

from layers import attention
from layers import feed_forward
from layers import norms

NORM_POSITIONS = ('pre', 'post')


class Block(nnx.Module):
  """One layer.

  Pre-LN (Xiong et al. 2020): x + f(norm(x)); the residual path is the identity, so gradients reach
  every layer unscaled and training is stable without warmup; the stack then needs a final norm.
  Post-LN (Vaswani et al. 2017): norm(x + f(x)); the original, which at depth needs learning-rate
  warmup because the gradients near the output are large at initialisation.
  """

  def __init__(self, cfg, *, cross_attention=False, rngs):
    """Args:
      cfg: `config.model` (d_model, num_heads, num_kv_heads, d_ff, norm, norm_position, ffn,
        attention, attention_impl, dropout, use_bias, window).
      cross_attention: add a cross-attention sublayer (encoder-decoder decoders).
      rngs: parameter initialisation.
    """
    if cfg.attention not in attention.VARIANTS:
      raise ValueError(f'attention {cfg.attention!r} unknown; valid: {sorted(attention.VARIANTS)}')
    if cfg.norm not in norms.NORMS:
      raise ValueError(f'norm {cfg.norm!r} unknown; valid: {sorted(norms.NORMS)}')
    if cfg.norm_position not in NORM_POSITIONS:
      raise ValueError(f'norm_position {cfg.norm_position!r} unknown; valid: {list(NORM_POSITIONS)}')
    self.pre = cfg.norm_position == 'pre'
    make_norm = norms.NORMS[cfg.norm]

    def make_attention():
      return attention.VARIANTS[cfg.attention](
          cfg.d_model, cfg.num_heads, cfg.num_kv_heads, use_bias=cfg.use_bias,
          implementation=cfg.attention_impl, rngs=rngs)

    self.self_attention = make_attention()
    self.self_norm = make_norm(cfg.d_model, rngs=rngs)
    self.cross_attention = make_attention() if cross_attention else None
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
    x = self._sublayer(x, self.self_norm, lambda h: self.self_attention(
        h, segment_ids=segment_ids, positions=positions, is_causal=is_causal,
        position=position), rngs)
    if self.cross_attention is not None:
      # Cross-attention carries no position term (as in T5 and ALiBi's reference): alignment is
      # learned from content, and the encoder's positions are already in its outputs.
      x = self._sublayer(x, self.cross_norm, lambda h: self.cross_attention(
          h, context, segment_ids=segment_ids, context_segment_ids=context_segment_ids), rngs)
    return self._sublayer(x, self.ffn_norm, self.ffn, rngs)
