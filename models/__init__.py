"""Model architectures, keyed by `config.model.arch`."""

from models import decoder_only

ARCHS = {
    'decoder_only': decoder_only.DecoderOnly,
}


def build(cfg, vocab_size, max_length, *, rngs):
  """Builds `config.model.arch` for a vocabulary of `vocab_size` and sequences up to `max_length`."""
  if cfg.arch not in ARCHS:
    raise ValueError(f'arch {cfg.arch!r} unknown; valid: {sorted(ARCHS)}')
  return ARCHS[cfg.arch](cfg, vocab_size, max_length, rngs=rngs)
