"""A training process for the multi-process tests: train.py's flags, plus `--sigterm_after=N`, a
hook (training.loop's `hooks`) by which this process sends itself SIGTERM after step N."""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests import helpers
from training import distributed
from training import loop
from training import validation

config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py).', lock_config=True)
flags.DEFINE_string('workdir', None, 'The run directory.')
flags.DEFINE_integer('sigterm_after', None, 'Send this process SIGTERM after this step.')
distributed.define_distributed_flags()
FLAGS = flags.FLAGS


def main(argv):
  del argv
  distributed.init_distributed(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  config = validation.resolve(FLAGS.config.unlock())
  validation.validate(config)
  hooks = [] if FLAGS.sigterm_after is None else [helpers.sigterm_after(FLAGS.sigterm_after)]
  try:
    loop.train_and_evaluate(config, FLAGS.workdir, hooks=hooks)
  except loop.Stopped as e:
    print(str(e), file=sys.stderr)
    sys.exit(128 + e.signum)


if __name__ == '__main__':
  app.run(main)
