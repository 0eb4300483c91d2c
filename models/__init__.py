"""Model architectures, keyed by `config.model.arch`."""

from models import decoder_only
from models import encoder_decoder
from models import encoder_only
from models import rnn_seq2seq

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


def batch_format(arch):
  """The `data.pipeline` batch format of `arch`."""
  if arch not in BATCH_FORMATS:
    raise ValueError(f'arch {arch!r} unknown; valid: {sorted(BATCH_FORMATS)}')
  return BATCH_FORMATS[arch]


def build(cfg, vocab_size, max_length, *, rngs):
  """Builds `config.model.arch` for a vocabulary of `vocab_size` and sequences up to `max_length`."""
  if cfg.arch not in ARCHS:
    raise ValueError(f'arch {cfg.arch!r} unknown; valid: {sorted(ARCHS)}')
  return ARCHS[cfg.arch](cfg, vocab_size, max_length, rngs=rngs)
