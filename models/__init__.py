"""Model architectures, keyed by `config.model.arch`, each declaring its shape (models.contract)."""

from models import contract
from models import decoder_only
from models import encoder_decoder
from models import encoder_only
from models import rnn_seq2seq
from models import stack

SpecialIds = encoder_only.SpecialIds  # the token ids `build(..., special_ids=)` takes
ArchSpec = contract.ArchSpec
StackSpec = contract.StackSpec

# Each class takes `(cfg, vocab_size, max_length, *, rngs, special_ids=None)` and declares an
# `ArchSpec` as its `spec`: its stacks, batch format, decoder, tasks, packings and options.
ARCHS = {
    'decoder_only': decoder_only.DecoderOnly,
    'encoder_only': encoder_only.EncoderOnly,
    'encoder_decoder': encoder_decoder.EncoderDecoder,
    'rnn_seq2seq': rnn_seq2seq.RNNSeq2Seq,
}


def spec(arch):
  """The `ArchSpec` of `arch` (a key of `ARCHS`).

  Raises:
    ValueError: `arch` is not registered (the message lists the valid keys).
  """
  if arch not in ARCHS:
    raise ValueError(f'arch {arch!r} unknown; valid: {sorted(ARCHS)}')
  return ARCHS[arch].spec


def archs_where(predicate, *, ordered=True):
  """The registered archs whose `ArchSpec` satisfies `predicate`, sorted (or, `ordered` False,
  in registry order): what a message lists as the valid values (e.g.
  `archs_where(lambda s: s.causal_lm)`)."""
  names = sorted(ARCHS) if ordered else list(ARCHS)
  return [name for name in names if predicate(ARCHS[name].spec)]


def layer_attentions(cfg):
  """{role: the self-attention variant of each layer} of `cfg.arch`'s Transformer stacks (the
  roles of its `ArchSpec.stacks`; {} for an arch without any): `model.attention` in every layer,
  or `model.layer_pattern` repeated (models.stack.layer_attentions)."""
  return {s.role: stack.layer_attentions(s.config(cfg)) for s in spec(cfg.arch).stacks}


def batch_format(arch):
  """The `data.pipeline` batch format of `arch`."""
  return spec(arch).batch_format


def build(cfg, vocab_size, max_length, *, rngs, special_ids=None):
  """Builds `config.model.arch` for a vocabulary of `vocab_size` and sequences up to `max_length`.

  Args:
    cfg: a resolved `config.model`.
    vocab_size: V, the tokenizer's vocabulary size.
    max_length: the longest sequence (learned position tables).
    rngs: `nnx.Rngs` for the initialisation.
    special_ids: a `SpecialIds` (`SpecialIds.from_tokenizer(tokenizer)`): the ids a masking arch
      (encoder_only) masks by; the others ignore them. A masking model built without them runs
      its forward pass (parameter counts, attention maps) but refuses to mask.
  """
  spec(cfg.arch)  # an unknown arch lists the valid ones
  return ARCHS[cfg.arch](cfg, vocab_size, max_length, rngs=rngs, special_ids=special_ids)
