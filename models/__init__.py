"""Model architectures, keyed by `config.model.arch`."""

from models import decoder_only
from models import encoder_decoder
from models import encoder_only
from models import rnn_seq2seq
from models import stack

SpecialIds = encoder_only.SpecialIds  # the token ids `build(..., special_ids=)` takes

ARCHS = {
    'decoder_only': decoder_only.DecoderOnly,
    'encoder_only': encoder_only.EncoderOnly,
    'encoder_decoder': encoder_decoder.EncoderDecoder,
    'rnn_seq2seq': rnn_seq2seq.RNNSeq2Seq,
}

# The batch format (a key of data.pipeline.ARCHS) each architecture reads.
BATCH_FORMATS = {
    'decoder_only': 'decoder_only',
    'encoder_only': 'encoder_only',
    'encoder_decoder': 'encoder_decoder',
    'rnn_seq2seq': 'encoder_decoder',
}



def _same(cfg):
  return cfg


# The Transformer stacks of each architecture, by role ('encoder' bidirectional, 'decoder' causal):
# the stack's config from `config.model` (an encoder-decoder's decoder reads decoder_attention).
STACKS = {
    'decoder_only': {'decoder': _same},
    'encoder_only': {'encoder': _same},
    'encoder_decoder': {'encoder': _same, 'decoder': encoder_decoder.decoder_config},
    'rnn_seq2seq': {},
}


def layer_attentions(cfg):
  """{role: the self-attention variant of each layer} of `cfg.arch`'s Transformer stacks (the
  roles of `STACKS`; {} for rnn_seq2seq): `model.attention` in every layer, or
  `model.layer_pattern` repeated (models.stack.layer_attentions)."""
  return {role: stack.layer_attentions(config_of(cfg))
          for role, config_of in STACKS[cfg.arch].items()}


def batch_format(arch):
  """The `data.pipeline` batch format of `arch`."""
  if arch not in BATCH_FORMATS:
    raise ValueError(f'arch {arch!r} unknown; valid: {sorted(BATCH_FORMATS)}')
  return BATCH_FORMATS[arch]


def build(cfg, vocab_size, max_length, *, rngs, special_ids=None):
  """Builds `config.model.arch` for a vocabulary of `vocab_size` and sequences up to `max_length`.

  Args:
    cfg: a resolved `config.model`.
    vocab_size: V, the tokenizer's vocabulary size.
    max_length: the longest sequence (learned position tables).
    rngs: `nnx.Rngs` for the initialisation.
    special_ids: a `SpecialIds` (`SpecialIds.from_tokenizer(tokenizer)`): the ids encoder_only
      masks by; the other archs take none. An encoder_only model built without them runs its
      forward pass (parameter counts, attention maps) but refuses to mask.
  """
  if cfg.arch not in ARCHS:
    raise ValueError(f'arch {cfg.arch!r} unknown; valid: {sorted(ARCHS)}')
  if cfg.arch == 'encoder_only':
    return ARCHS[cfg.arch](cfg, vocab_size, max_length, rngs=rngs, special_ids=special_ids)
  return ARCHS[cfg.arch](cfg, vocab_size, max_length, rngs=rngs)
