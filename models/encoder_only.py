"""Encoder-only (BERT-style) masked-token prediction over `<bos> source <sep> target <eos>`."""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models import contract
from models import stack

EVAL_MASK_SEED = 0  # evaluation masks with this fixed key, so its numbers are deterministic


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """The token ids the masking treats apart; they come from the tokenizer, through the caller.

  Attributes:
    pad, bos, eos, sep: never chosen for prediction: they carry the layout of the row, not
      content to predict (`sep` also marks where the target side starts).
    mask: the id that replaces a chosen token.
    first_word: random replacements are drawn from the ids in [first_word, V).
  """
  pad: int
  bos: int
  eos: int
  sep: int
  mask: int
  first_word: int

  @property
  def layout(self):
    """The ids that are never masked: (pad, bos, eos, sep)."""
    return (self.pad, self.bos, self.eos, self.sep)

  @classmethod
  def from_tokenizer(cls, tokenizer):
    """The ids of a tokenizer with `pad_id`, `bos_id`, `eos_id`, `sep_id`, `mask_id` and `unk_id`
    whose words follow its special ids (`data.tokenizer.Tokenizer`), or which says where its words
    start (`first_word_id`: a Hugging Face tokenizer's specials lie anywhere).

    A tokenizer may lack some ids (None: a Hugging Face tokenizer without a bos, sep or mask): a
    missing bos or sep stands for its eos (a layout id either way); a missing mask is the eos too,
    and validation refuses a masking model with such a tokenizer.
    """
    eos = tokenizer.eos_id
    ids = {name: eos if value is None else value for name, value in (
        ('pad', tokenizer.pad_id), ('bos', tokenizer.bos_id), ('eos', eos),
        ('sep', tokenizer.sep_id), ('mask', tokenizer.mask_id))}
    first_word = getattr(tokenizer, 'first_word_id', None)
    if first_word is None:
      specials = list(ids.values()) + [tokenizer.unk_id]
      first_word = max(i for i in specials if i is not None) + 1
    return cls(**ids, first_word=first_word)


def mlm_mask(rng, inputs, weights, vocab_size, *, special_ids, rate=0.15, mask_prob=0.8,
             random_prob=0.1, target_rate=0.0):
  """BERT's masking (Devlin et al. 2019): choose `rate` of the real tokens to predict; replace 80%
  of those by `<mask>`, 10% by a random word, keep 10%.

  Args:
    rng: a jax key.
    inputs: `[B, T]` token ids.
    weights: `[B, T]`, > 0 on real tokens (0 on padding).
    vocab_size: V (random replacements are words, ids in [special_ids.first_word, V)).
    special_ids: a `SpecialIds`: the layout ids never chosen, the `<mask>` id, the first word id.
    rate, mask_prob, random_prob: the chosen share, and the <mask> / random shares of it.
    target_rate: share of rows whose whole target side (after `<sep>`) is chosen and replaced by
      `<mask>` instead (non-autoregressive translation; 0 = plain BERT).

  Returns:
    (corrupted inputs `[B, T]`, chosen `[B, T]` float32: 1 where the loss is taken).
  """
  ids = special_ids
  k_choose, k_kind, k_random, k_row = jax.random.split(rng, 4)
  special = jnp.isin(inputs, jnp.asarray(ids.layout, inputs.dtype))
  candidate = (weights > 0) & ~special  # [B, T]
  chosen = candidate & jax.random.bernoulli(k_choose, rate, inputs.shape)  # [B, T]
  u = jax.random.uniform(k_kind, inputs.shape)
  random_ids = jax.random.randint(k_random, inputs.shape, ids.first_word, vocab_size,
                                  dtype=inputs.dtype)
  corrupted = jnp.where(chosen & (u < mask_prob), ids.mask, inputs)
  corrupted = jnp.where(chosen & (u >= mask_prob) & (u < mask_prob + random_prob), random_ids,
                        corrupted)
  if target_rate > 0:
    after_sep = jnp.cumsum(inputs == ids.sep, axis=1) > 0  # [B, T]
    whole = jax.random.bernoulli(k_row, target_rate, inputs.shape[:1])[:, None]  # [B, 1]
    target = whole & candidate & after_sep
    chosen = jnp.where(whole, target, chosen)
    corrupted = jnp.where(whole, jnp.where(target, ids.mask, inputs), corrupted)
  return corrupted.astype(inputs.dtype), chosen.astype(jnp.float32)


class EncoderOnly(nnx.Module):
  """Bidirectional stack; the output projection is tied to the token embedding (or untied:
  tie_output).

  The forward pass needs no token ids; masking (`mask`, `loss_terms`) needs `special_ids`.
  """

  spec = contract.ArchSpec(
      stacks=(contract.StackSpec('encoder', causal=False),), batch_format='same_token',
      translation='fill', documents=True,
      options=('mlm_rate', 'mlm_mask_prob', 'mlm_random_prob', 'mlm_target_rate'))

  def __init__(self, cfg, vocab_size, max_length, *, rngs, special_ids=None):
    self.encoder = stack.Stack(cfg, vocab_size, max_length, output=True, rngs=rngs)
    self.vocab_size = vocab_size
    self.special_ids = special_ids
    self.rate = cfg.get('mlm_rate', 0.15)
    self.mask_prob = cfg.get('mlm_mask_prob', 0.8)
    self.random_prob = cfg.get('mlm_random_prob', 0.1)
    self.target_rate = cfg.get('mlm_target_rate', 0.0)

  def __call__(self, batch, *, rngs=None):
    """Args:
      batch: `inputs` `[B, T]` (already corrupted) and optionally `segment_ids`, `positions`.
      rngs: dropout randomness while training, None at evaluation.

    Returns:
      `[B, T, V]` float32 logits of the original token at each position.
    """
    return self.encoder.logits(self.features(batch, rngs=rngs))

  def features(self, batch, *, rngs=None):
    """`[B, T, D]` the final hidden states (the logits before `output_embedding()`)."""
    return self.encoder(batch['inputs'], segment_ids=batch.get('segment_ids'),
                        positions=batch.get('positions'), is_causal=False, rngs=rngs)

  def output_embedding(self):
    """`[V, D]` the tied output projection (models.stack.Stack.output_table)."""
    return self.encoder.output_table()

  def output_softcap(self):
    """c of the logits' soft cap c·tanh(x / c) after `output_embedding()` (0 = none)."""
    return self.encoder.final_logit_softcap

  def mask(self, batch, rng, *, target_rate=None):
    """Returns (corrupted inputs, chosen) of `batch` with this model's masking config."""
    if self.special_ids is None:
      raise ValueError('encoder_only masks tokens by their ids: build it with '
                       'models.build(..., special_ids=models.SpecialIds.from_tokenizer(tokenizer))')
    return mlm_mask(rng, batch['inputs'], batch['weights'], self.vocab_size,
                    special_ids=self.special_ids, rate=self.rate, mask_prob=self.mask_prob,
                    random_prob=self.random_prob,
                    target_rate=self.target_rate if target_rate is None else target_rate)

  def loss_terms(self, batch, *, rngs=None):
    """(logits, original tokens, chosen positions): the loss is on the masked positions only.

    `rngs.mask` draws the masks while training; with rngs None (evaluation) a fixed key is used,
    so the validation numbers (masked-token accuracy) are deterministic.
    """
    hidden, targets, weights = self.loss_features(batch, rngs=rngs)
    return self.encoder.logits(hidden), targets, weights

  def loss_features(self, batch, *, rngs=None):
    """`loss_terms` with the hidden states `[B, T, D]` in place of the logits (a tiled loss)."""
    rng = rngs.mask() if rngs is not None else jax.random.key(EVAL_MASK_SEED)
    corrupted, chosen = self.mask(batch, rng)
    hidden = self.features({**batch, 'inputs': corrupted}, rngs=rngs)
    return hidden, batch['targets'], chosen * batch['weights']

  def attention_weights(self, batch):
    """Per layer {'self': `[B, N, T, T]`} (plots)."""
    return self.encoder.attention_weights(batch['inputs'], segment_ids=batch.get('segment_ids'),
                                          positions=batch.get('positions'))
