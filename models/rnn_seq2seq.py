"""RNN encoder-decoder baseline (LSTM or GRU) with Bahdanau, Luong or no attention."""

import jax
import jax.numpy as jnp
from flax import nnx

from layers import rnn_attention
from models import contract
from models import stack

# Recurrent cells, keyed by `config.model.rnn_cell`.
CELLS = {
    'lstm': nnx.LSTMCell,
    'gru': nnx.GRUCell,
}


def _hidden(carry):
  """The output state h of a cell's carry (LSTM: (c, h); GRU: h)."""
  return carry[1] if isinstance(carry, tuple) else carry


class RNNSeq2Seq(nnx.Module):
  """Encoder RNN over `source <eos>`; decoder RNN with input feeding (Luong et al. 2015).

  Step t: s_t = cell(s_{t-1}, [embed(y_{t-1}); c_{t-1}]); c_t = attention(s_t, encoder states);
  output tanh(W [s_t; c_t]), projected to the vocabulary by the (tied) embedding (and soft-capped
  as the Transformers' logits with model.final_logit_softcap > 0). Both scoring functions use this
  ordering (attention from the current state), so they differ only in the score. With `none`, c_t
  is the encoder's final state at every step: the fixed-size bottleneck.
  Same batch format as encoder_decoder (packing='none': one pair per row).
  """

  # No Transformer stack: no KV cache (its recurrent state is the decoding cache), no closed forms.
  spec = contract.ArchSpec(
      batch_format='source_target', translation='source', packings=('none',),
      packing_note=' (a recurrence reads one pair per row)', tiled_loss=False,
      options=('rnn_cell', 'rnn_attention', 'rnn_luong_scale'))

  def __init__(self, cfg, vocab_size, max_length, *, rngs, special_ids=None):
    del max_length, special_ids  # recurrences have no length limit; no masking
    d = cfg.d_model
    cell_name = cfg.get('rnn_cell', 'lstm')
    if cell_name not in CELLS:
      raise ValueError(f'rnn_cell {cell_name!r} unknown; valid: {sorted(CELLS)}')
    self.embed = nnx.Embed(vocab_size, d, rngs=rngs,
                           embedding_init=nnx.initializers.normal(stddev=d ** -0.5))
    self.encoder = nnx.RNN(CELLS[cell_name](d, d, rngs=rngs), return_carry=True, rngs=False)
    self.cell = CELLS[cell_name](2 * d, d, rngs=rngs)
    self.attention = rnn_attention.make(cfg.get('rnn_attention', 'bahdanau'), d, d, d,
                                        scale=cfg.get('rnn_luong_scale', True), rngs=rngs)
    self.combine = nnx.Linear(2 * d, d, rngs=rngs)
    self.dropout = nnx.Dropout(cfg.dropout)
    self.d_model = d
    self.cell_name = cell_name
    self.final_logit_softcap = float(cfg.get('final_logit_softcap', 0.0))  # 0 = none

  def init_cache(self, batch, max_length=None, dtype=jnp.float32):
    """Encodes the source; the 'cache' of an RNN is its state plus the encoder memory.

    Returns:
      {'self': {'carry', 'ctx' `[B, D]`} (the part beam search reorders), 'memory' `[B, S, D]`
      (or `[B, D]` without attention), 'keys', 'mask' `[B, S]`}.
    """
    del max_length, dtype
    return self._encode(batch, None)

  def _encode(self, batch, rngs):
    src = batch['src_inputs']  # [B, S]
    seg = batch.get('src_segment_ids')
    mask = jnp.ones(src.shape, bool) if seg is None else seg > 0  # [B, S]
    x = self.dropout(self.embed(src), deterministic=rngs is None, rngs=rngs)  # [B, S, D]
    zeros = jnp.zeros((src.shape[0], self.d_model), x.dtype)  # [B, D]
    initial = (zeros, zeros) if self.cell_name == 'lstm' else zeros  # LSTM carry is (c, h)
    carry, states = self.encoder(x, initial_carry=initial,
                                 seq_lengths=jnp.sum(mask, axis=1))  # states [B, S, D]
    if isinstance(self.attention, rnn_attention.NoAttention):
      memory = _hidden(carry)  # [B, D]
      ctx = memory
    else:
      memory = states
      ctx = jnp.zeros((src.shape[0], self.d_model), states.dtype)  # [B, D]
    return {'self': {'carry': carry, 'ctx': ctx}, 'memory': memory,
            'keys': self.attention.prepare(memory), 'mask': mask}

  def _step(self, state, x, cache):
    """One decoder step from input embeddings `x` `[B, D]`; returns (state, output, weights)."""
    carry, h = self.cell(state['carry'], jnp.concatenate([x, state['ctx']], axis=-1))
    ctx, weights = self.attention(h, cache['keys'], cache['memory'], cache['mask'])
    out = jnp.tanh(self.combine(jnp.concatenate([h, ctx], axis=-1)))  # [B, D]
    return {'carry': carry, 'ctx': ctx}, out, weights

  def _decode_all(self, batch, rngs):
    cache = self._encode(batch, rngs)
    x = self.dropout(self.embed(batch['tgt_inputs']), deterministic=rngs is None,
                     rngs=rngs)  # [B, T, D]
    graphdef, params = nnx.split(self)

    def body(state, x_t):
      model = nnx.merge(graphdef, params)
      state, out, weights = model._step(state, x_t, cache)
      return state, (out, weights)

    _, (outs, weights) = jax.lax.scan(body, cache['self'], x.swapaxes(0, 1))
    return outs.swapaxes(0, 1), weights.swapaxes(0, 1)  # [B, T, D], [B, T, S]

  def __call__(self, batch, *, rngs=None):
    """`[B, T, V]` float32 next-token logits (teacher forcing); batch as encoder_decoder's."""
    outs, _ = self._decode_all(batch, rngs)
    outs = self.dropout(outs, deterministic=rngs is None, rngs=rngs)
    return self._logits(outs)  # [B, T, V]

  def _logits(self, out):
    """`[..., V]` float32 logits of decoder outputs `[..., D]` (the tied embedding), soft-capped
    (models.stack.softcap) when `final_logit_softcap` > 0."""
    return stack.softcap(self.embed.attend(out).astype(jnp.float32), self.final_logit_softcap)

  def loss_terms(self, batch, *, rngs=None):
    """(logits, `tgt_targets`, `tgt_weights`)."""
    return self(batch, rngs=rngs), batch['tgt_targets'], batch['tgt_weights']

  def attention_weights(self, batch):
    """[{'cross': `[B, 1, T, S]`}]: the decoder's attention over the source (one 'head')."""
    _, weights = self._decode_all(batch, None)
    return [{'cross': weights[:, None]}]

  def decode_step(self, cache, tokens, index):
    """Feeds `tokens` `[B]`; returns (`[B, V]` logits, cache). `index` is unused."""
    del index
    state, out, _ = self._step(cache['self'], self.embed(tokens), cache)
    return self._logits(out), {**cache, 'self': state}
