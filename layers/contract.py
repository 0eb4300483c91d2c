"""The contract between position methods, attention variants and kernels.

A position method hands attention a `ScoreTerms` (what it adds to the `[T, S]` scores) and declares
which of its fields it may set (`Position.terms_for`); the attention layer adds its own (the logit
soft cap, the sinks: `Attention.layer_terms`). A kernel declares in one `Kernel` row which fields it
takes. An attention variant declares whether it runs a kernel at all and which cached step it has.
training/validation.py derives every compatibility rule from these declarations; no rule about a
particular position or kernel is written anywhere else.
"""

import dataclasses
from typing import Any, Callable

# The fields of ScoreTerms, and how a message names each. A new field joins all three tables; a
# kernel takes it only once its row lists it.
TERMS = ('bias', 'alibi_slopes', 'position_bias', 'mask', 'softcap', 'sinks')
TERM_NAMES = {
    'bias': 'a dense [T, S] bias',
    'alibi_slopes': 'ALiBi slopes',
    'position_bias': 'a learned bias function of the positions, evaluated per tile',
    'mask': 'a [T, S] mask',
    'softcap': 'a logit soft cap',
    'sinks': 'attention sinks',
}
# What each field does to the softmax: 'add' to the scaled scores, 'mask' keys, 'transform' the
# logits (after the added terms, before the mask), or join the 'denominator' only.
TERM_KINDS = {'bias': 'add', 'alibi_slopes': 'add', 'position_bias': 'add', 'mask': 'mask',
              'softcap': 'transform', 'sinks': 'denominator'}


@dataclasses.dataclass(frozen=True)
class ScoreTerms:
  """What a position method adds to attention's scores; every field is optional.

  Attributes:
    bias: float, broadcastable to `[B, N, T, S]`, added to the scaled scores (T5's bucket table).
    alibi_slopes: `[N]`; the kernel adds -slope * |i - j| on its tiles (ALiBi).
    position_bias: a `layers.relative_bias.PositionBias`, a learned function of the positions the
      kernel evaluates per tile (FIRE, KERPLE).
    mask: boolean, broadcastable to `[B, 1, T, S]`, True where a key may be seen (xPos's blocks).
    softcap: a float c > 0: every logit s (scaled q·k plus the added terms) becomes c·tanh(s / c),
      before the mask (Gemma 2's attention logit soft-capping).
    sinks: `[N]` float32, a learned logit per query head that joins the softmax's denominator
      only: p_ij = exp(s_ij) / (exp(sink_n) + sum_j exp(s_ij)); it has no value (GPT-OSS).
  """

  bias: Any = None
  alibi_slopes: Any = None
  position_bias: Any = None
  mask: Any = None
  softcap: Any = None
  sinks: Any = None

  def names(self):
    """The fields that are set, in `TERMS` order."""
    return tuple(name for name in TERMS if getattr(self, name) is not None)

  def kwargs(self):
    """The set fields as keyword arguments of `layers.attention.dot_product_attention`."""
    return {name: getattr(self, name) for name in self.names()}

  def logit_kwargs(self):
    """`kwargs` less the sinks: the terms that shape the `[T, S]` logits
    (`layers.attention_xla.scores`); the sinks join the normalisation after."""
    return {name: value for name, value in self.kwargs().items() if name != 'sinks'}

  def __bool__(self):
    return bool(self.names())


NONE = ScoreTerms()


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One exact-softmax kernel (`config.model.attention_impl`) and what it takes.

  Attributes:
    fn: `fn(q, k, v, bias, mask, *, scale, is_causal, window, alibi_slopes, q_segment_ids,
      kv_segment_ids, **extra)` -> `[B, T, N, H]` (extra: position_bias, softcap, sinks,
      dropout_rate/seed, each passed only when set).
    terms: the ScoreTerms fields it evaluates (`TERMS`; the transforms and the sinks included).
    dropout: it takes attention dropout (model.attention_dropout > 0).
    sequence_mesh: 'any' (GSPMD partitions it), 'never' (each device holds the whole sequence:
      mesh.sequence must be 1) or 'needed' (it splits the length: mesh.sequence > 1).
    platforms: the jax backends it runs on.
    decodes: it serves the one-row cached decoding step; the others leave that step to 'xla'.
    value_width: v's head dim may differ from q's and k's (MLA: H beside H + d_h^R); a caller of
      a kernel without it pads v with zeros to their width.
    single_device: the kernel that computes the same attention in its place on one device (eval.py
      has no training mesh), for a kernel that needs one (`sequence_mesh='needed'`); '' = itself.
    score_matmuls: the [T, S] x H matrix products one training step computes per layer (what FLOP
      counts of the kernel read): 2 forward (QKᵀ, PV); backward 4 from stored probabilities
      (dV, dP, dQ, dK), one more where it recomputes QKᵀ, two more where dQ and dK/dV are separate
      passes that each recompute QKᵀ and dP.
    tiles: ((lowering platform, (block_q, block_k)), ...) where it skips the tiles a causal mask or
      a window hides (layers.flash_core.visited_tiles counts the rest); () = the full matrix.
  """

  fn: Callable
  terms: tuple = TERMS
  dropout: bool = False
  sequence_mesh: str = 'any'
  platforms: tuple = ('cpu', 'gpu', 'tpu')
  decodes: bool = False
  value_width: bool = False
  single_device: str = ''
  score_matmuls: int = 6
  tiles: tuple = ()

  def missing(self, terms):
    """The names in `terms` this kernel cannot take."""
    return [name for name in terms if name not in self.terms]


class PositionDeclarations:
  """What a position method declares, with NoPE's defaults (layers.positions.Position and
  layers.rope.RoPE, which the positions module builds on, both take them from here).

  Attributes:
    terms: the `layers.contract.ScoreTerms` fields `in_attention` may set (ALiBi's slopes, T5's
      bias, ...): only attention with `[T, S]` scores takes them, and each kernel only those it
      declares (`layers.contract.Kernel.terms`). `terms_for` refines it by the config.
    rotates: `in_attention` rotates q and k (RoPE, xPos).
    rotates_any_width: it also has `rotate(x, positions)`, the same rotation for a tensor of any
      even width, which a variant with a rotary part of its own applies to it (MLA's decoupled
      key); False where the rotation belongs to the head width it was built for (xPos's decay).
    random_ids: it reads absolute position ids, which `model.random_positions_max` may randomize
      (Ruoss et al. 2023); the relative methods see only differences and are left alone.
    exclusive_options: {field: (off value, what it does)}: `config.model` fields only this method
      reads; validation refuses another value under a method that does not declare the field.
    eval_options: `config.model` fields eval.py may change on a trained model (no parameter
      depends on them): validated as a changed config, applied by `set_eval_options`.
    param_form: `param_count` in words (tools.accounting's table).
  """

  terms = ()
  rotates = False
  rotates_any_width = False
  random_ids = False
  exclusive_options = {}
  eval_options = ()
  param_form = '0'

  @classmethod
  def terms_for(cls, model_cfg):
    """The ScoreTerms fields this method sets under `config.model` (default: `terms`)."""
    del model_cfg
    return cls.terms

  @classmethod
  def max_positions(cls, model_cfg, max_length):
    """The most positions a model trained at `max_length` can take (None: any number)."""
    del model_cfg, max_length

  @classmethod
  def param_count(cls, model_cfg, max_length):
    """One stack's parameters of this method, built for training length `max_length`."""
    del model_cfg, max_length
    return 0

  def set_eval_options(self, model_cfg):
    """Applies the `eval_options` of `config.model` to this built method, in place."""
    del model_cfg
