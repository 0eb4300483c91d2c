"""Trains an attnlab model: `python train.py --config=configs/NAME.py --workdir=DIR`.

Resumes from the newest checkpoint in DIR (parameters, optimiser and data position), so a killed run
rerun with the same command continues with exactly the batches it would have seen. The work is done
by the `training` library (`training.loop.train_and_evaluate`); this file holds the flags and main.
"""

import sys

from training import host
from training import supervisor

host.die_with_parent()  # a sweep cell goes when its runner does
host.exit_at_once_on_signals('train')  # before the slow imports: a Ctrl-C now is one line
host.cpu_when_no_accelerator()  # before JAX starts
supervisor.supervise('train')  # several processes: a lost one is reported in one line
supervisor.route_native_output()  # ... and C++ traces go to WORKDIR/logs, not the terminal


from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from data import pipeline  # noqa: E402
from data import preparation  # noqa: E402
from layers import options  # noqa: E402
from training import checkpointing  # noqa: E402
from training import cli_checks  # noqa: E402
from training import distributed  # noqa: E402
from training import loop  # noqa: E402
from training import memory  # noqa: E402
from training import paths  # noqa: E402
from training import quiet  # noqa: E402
from training import state as state_lib  # noqa: E402
from training import train_checks  # noqa: E402

FLAGS = flags.FLAGS

config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py).', lock_config=True)
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, metrics and logs: a local '
                    'path or a gs:// URL.')
# Sweeps moved to their own tool; the old flags name the new command.
flags.DEFINE_string('sweep', None,
                    'Moved: use `python -m tools.sweep --sweep=... --sweep_dir=...`.')
flags.DEFINE_string('sweep_dir', None, 'Moved to `python -m tools.sweep`.')
flags.DEFINE_bool('dry_run', False, 'Moved to `python -m tools.sweep`.')
flags.DEFINE_list('seeds', None, 'Moved to `python -m tools.sweep`.')
flags.DEFINE_integer('parallel', 1, 'Moved to `python -m tools.sweep`.')
flags.DEFINE_bool('sweep_eval', False, 'Moved to `python -m tools.sweep`.')
flags.DEFINE_bool('memory_check', True, 'Refuse a run whose estimated training memory '
                  '(models.accounting) exceeds the device\'s before compiling; --nomemory_check '
                  'skips the estimate (an XLA out-of-memory is still reported in one line).')
distributed.define_distributed_flags()
host.define_host_malloc_flag()

_SWEEP_FLAGS = ('sweep', 'sweep_dir', 'dry_run', 'seeds', 'parallel', 'sweep_eval')


def moved_to_sweep_tool(argv):
  """The `python -m tools.sweep ...` command that replaces a `train.py --sweep ...` one."""
  args = [a for a in argv[1:] if a.lstrip('-').split('=')[0].removeprefix('no') in _SWEEP_FLAGS]
  return ' '.join(['python -m tools.sweep'] + args)


def main(argv):
  if len(argv) > 1:
    cli_checks.fail('train', f'unexpected arguments {argv[1:]}; valid: flags only (--config, '
                    '--workdir, --config.FIELD=VALUE, ...)')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
  quiet.drop_harmless_warnings()  # ... and a few warnings that need no action
  supervisor.quiet_fault_dumps()
  if FLAGS.sweep:
    print(f'train: sweeps moved to their own tool; run: {moved_to_sweep_tool(sys.argv)}',
          file=sys.stderr)
    sys.exit(2)
  if FLAGS.config is None:
    cli_checks.fail('train', '--config is required; valid: a config file, e.g. '
                    'configs/decoder_only.py:quick')
  if host.host_malloc_wanted(FLAGS.host_malloc):
    host.tune_host_malloc()  # before the first JAX call: the arena limit binds later threads only
  try:
    cli_checks.check_workdir(FLAGS.workdir)
    distributed.init_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                 FLAGS.process_id, FLAGS.multihost, FLAGS.heartbeat_timeout,
                                 FLAGS.init_timeout)
    config = train_checks.check_train_run(FLAGS.config.unlock(), FLAGS.workdir)
    vocab_size = state_lib.model_vocab_size(config, pipeline.get_tokenizer(config.data).vocab_size)
    limit = memory.device_limit()  # before the run takes any of it
    if FLAGS.memory_check:
      memory.check_training_memory(config, vocab_size, limit)
  except memory.OutOfMemory as e:
    cli_checks.fail('train', e)
  except paths.StoreUnreachable as e:
    cli_checks.fail('train', e, status=1)
  except preparation.PreparationFailed as e:  # a full disk while writing the dataset
    cli_checks.fail('train', e, status=1)
  except pipeline.DataError as e:  # your own data: a bad file (named, with the line) or vocab_size
    cli_checks.fail('data error', e)
  except options.ConfigError as e:
    cli_checks.fail('config error', e)
  notice = host.cpu_notice('train')
  if notice and not FLAGS.process_id:  # once: process 0 (or the only process)
    print(notice, file=sys.stderr)
  try:
    loop.train_and_evaluate(config, FLAGS.workdir)
  except checkpointing.IncompatibleResume as e:
    cli_checks.fail('train', e)
  except options.ConfigError as e:  # raised where the loop first meets the devices or data
    cli_checks.fail('config error', e)
  except checkpointing.RunFailed as e:  # non-finite loss, a failed save, no readable checkpoint
    if distributed.lost_peer(e):  # a save's barrier failed: a process is gone
      supervisor.await_abort(e)
    print(str(e), file=sys.stderr)
    cli_checks.exit_now(1)  # a failed save leaves threads that would hold the exit for ever
  except loop.Stopped as e:
    print(str(e), file=sys.stderr)
    sys.exit(128 + e.signum)  # the shell's convention for "ended by this signal"
  except Exception as e:
    if distributed.lost_peer(e):  # a collective failed: the coordination service names the lost
      supervisor.await_abort(e)  # process and ends this one; the parent says it in one line
    if not memory.is_out_of_memory(e):
      raise
    print(memory.out_of_memory_line(e, config, vocab_size, limit), file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app.run(main, flags_parser=cli_checks.flags_parser('train'))
