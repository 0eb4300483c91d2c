"""training.quiet: the harmless library warnings are dropped by message, every other one kept."""

import logging

from training import quiet


def test_the_harmless_warnings_go_and_the_others_stay():
  seen = []

  class Keep(logging.Handler):

    def emit(self, record):
      seen.append(record.getMessage())

  logger = logging.getLogger('absl')
  handler = Keep()
  logger.addHandler(handler)
  try:
    quiet.drop_harmless_warnings()
    quiet.drop_harmless_warnings()  # idempotent: one filter
    assert logger.filters.count(quiet._FILTER) == 1
    logger.warning('Metadata file does not exist: %s', '/w/0/state/_CHECKPOINT_METADATA')
    logger.warning('CheckpointManagerOptions.read_only=True, setting create=False.')
    logger.warning('Given directory is read only=%s', '/w/checkpoints')
    logger.warning('Using custom data configuration: %s', 'TextCorpusConfig(...)')
    logger.warning('Failed to read Metadata file: %s', '/w/x')
    logger.error('Metadata file does not exist? no: an error of another kind')
  finally:
    logger.removeHandler(handler)
    logger.removeFilter(quiet._FILTER)
  # Another warning stays, and so does an error, whatever its words.
  assert seen == ['Failed to read Metadata file: /w/x',
                  'Metadata file does not exist? no: an error of another kind']
