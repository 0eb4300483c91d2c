"""The library warnings a run prints that need no action, dropped by message (every other warning
still prints). Each entry says why it is harmless here."""

import logging

HARMLESS = {
    # Orbax reads an item's metadata file before its tree; checkpoints of a StandardSave item keep
    # the tree metadata the restore uses, and the restore checks every array's shape itself.
    'Metadata file does not exist': 'Orbax: per-item metadata, not used by the restore',
    # A read-only manager (init_from, eval.py) never saves: the options it overrides are unused.
    'CheckpointManagerOptions.read_only=True': 'Orbax: save options of a read-only manager',
    'Given directory is read only': 'Orbax: a read-only manager opened for a restore',
    # A text corpus's TFDS config is named by the hash of its files (data/text_corpus.py).
    'Using custom data configuration': 'TFDS: the corpus config named by its files',
}


class _DropHarmless(logging.Filter):

  def filter(self, record):
    return record.levelno > logging.WARNING or not str(record.msg).startswith(tuple(HARMLESS))


_FILTER = _DropHarmless()


def drop_harmless_warnings():
  """Installs the filter on absl's logger (through which Orbax and TFDS log); idempotent."""
  logger = logging.getLogger('absl')
  if _FILTER not in logger.filters:
    logger.addFilter(_FILTER)
