"""Sweeps: expand a configs/ablations/*.py grid into named cells and run each with train.py.

    python -m tools.sweep --sweep=configs/ablations/NAME.py[:ARG] --sweep_dir=DIR
        [--dry_run] [--seeds=0,1,2] [--parallel=N] [--sweep_eval] [--tune=FIELD:V1,V2,...]

A sweep file defines `get_config(arg=None)`, the base config of every cell, and `get_sweep()` (or
`get_sweep(arg=None)`, given the same `:ARG` as get_config, e.g. to shorten a `quick` sweep):

    {'grid': {'model.norm_position': ['pre', 'post'], 'train.warmup_steps': [0, 100]},
     'cells': [{'model.num_layers': 6}, {'model.num_layers': 12, 'train.learning_rate': 1e-3}],
     'seeds': [0, 1, 2],
     'eval_flags': ['--lengths=1,2,4'],
     'eval_variants': {'model.position=rope': ['--rope_scaling=ntk:4']}}

`'ladder': {'sizes': [{'model.d_model': 64, 'model.num_layers': 4}, ...], 'flops': [1e13, 3e13]}`
runs every cell at every size x training-FLOP budget x seed, each with the `train.steps` that
spends its budget on its own model: round(budget / (FLOPs per token x batch x length)), FLOPs per
token from `models.accounting.training_flops_per_token` of the cell's resolved config (its
attention variant and MoE included). The size's fields and the pseudo-field `ladder.flops=BUDGET`
join the cell's name; `train.py` gets `--config.train.steps=N` instead of it. `--dry_run` then
adds a table of parameters, tokens, tokens per parameter, steps and an estimated time on this host,
and a warning line for a cell outside 1 to 1,000 tokens per parameter; the runner writes
SWEEP_DIR/ladder.json, from which `tools.compare --baseline=VARIANT` fits each variant's frontier
(docs/sweeps.md, "Compute-matched ladders").

`'train.init_from': {'cell': {overrides}}` starts a cell from an earlier cell's parameters (same
seed; its workdir is passed), once that cell is done, also with --parallel (context_extension.py).

Every key is optional. `grid` is a full Cartesian product; `cells` an explicit list of override
dicts (for grids that are not full); with both, every cell is crossed with the grid. Overrides are
dotted config fields -> values. `seeds` set `train.seed` (default [0]). `eval_flags` are eval.py
flags for every cell (run with `--sweep_eval`, printed by `--dry_run`), or a dict from cell
selectors to flags, a cell taking those of every selector it matches ('' matches every cell);
`eval_variants` maps a cell selector (`field=value[,field=value]`, matched against the cell's
overrides) to further eval.py runs of the same checkpoint, one per flag string.

A cell's name lists its overrides sorted by field, then its seed:
`model.norm_position=post,train.warmup_steps=0,seed=1`; names are stable (independent of the order
the file lists fields in) and filesystem-safe. Each cell trains in `SWEEP_DIR/<name>` with
`train.py --config=<sweep file> --config.FIELD=VALUE ...`.

`--tune=train.learning_rate:5e-4,1e-3,2e-3` trains every cell at each value with the first seed,
keeps the smallest value whose final validation loss is within --tune_tolerance (0.003 nats by
default) of the lowest, trains the other seeds at it alone, and records the choices in
SWEEP_DIR/tune.json (tools/sweep/tune.py: the rule, the file).

SIGINT (Ctrl-C) or SIGTERM to the runner is forwarded to the cells running at that moment, which
save a checkpoint and stop; the runner waits for them, starts no further cell (nor eval), and
exits with 128 + the signal's number. Rerunning the same command resumes the sweep.

One runner per --sweep_dir: a second one started on the same folder is refused in one line (exit
2) while the first runs (tools/sweep/runner.py `sweep_lock`).
"""

import sys

from absl import app
from absl import flags

from training import cli_checks
from training import paths
from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec

FLAGS = flags.FLAGS
FINISHED = ('done', 'skipped', 'diverged', 'dry_run')  # results that leave nothing to rerun


def define_flags():
  """The CLI flags, defined only when run as a program (importing the package defines none)."""
  flags.DEFINE_string('sweep', None, 'The sweep file, configs/ablations/NAME.py[:ARG]; every cell '
                      'trains with train.py into --sweep_dir/<cell name>.')
  flags.DEFINE_string('sweep_dir', None, 'Directory of the sweep (local or gs://): one '
                      'workdir per cell.')
  flags.DEFINE_bool('dry_run', False, 'Print the train.py (and eval.py) command of every cell and '
                    'run nothing (for launching cells on a cluster).')
  flags.DEFINE_list('seeds', None, 'Seeds to run (default: the sweep file\'s).')
  flags.DEFINE_integer('parallel', 1, 'Cells run side by side, each on one XLA/OpenMP thread.')
  flags.DEFINE_bool('sweep_eval', False, 'Run the sweep file\'s eval.py flags on each finished '
                    'cell.')
  flags.DEFINE_string('tune', None, 'FIELD:V1,V2,... (e.g. train.learning_rate:5e-4,1e-3,2e-3): '
                      'each cell trains at every value with the first seed; its other seeds train '
                      'at the value with the lowest final validation loss; the choices go to '
                      '--sweep_dir/tune.json.')
  flags.DEFINE_float('tune_tolerance', None, '--tune\'s choice: the smallest value whose final '
                     'validation loss is within this many nats of the lowest (default 0.003, the '
                     'seed spread at one rate; 0 = the plain lowest).')


def main(argv):
  """Exits 0 when every cell finished (done, skipped, diverged or dry run), 1 when one failed (or a
  tuned cell's other seeds could not start), 2 on a missing flag, a sweep file or --tune that
  cannot be expanded, 128 + N when signal N stopped it."""
  if len(argv) > 1:
    cli_checks.fail('sweep', f'unexpected arguments {argv[1:]}; valid: flags only')
  if not FLAGS.sweep or not FLAGS.sweep_dir:
    print('sweep: --sweep and --sweep_dir are required', file=sys.stderr)
    sys.exit(2)
  if FLAGS.parallel < 1:
    cli_checks.fail('sweep', f'--parallel={FLAGS.parallel} must be a positive integer')
  if paths.exists(FLAGS.sweep_dir) and not paths.isdir(FLAGS.sweep_dir):
    cli_checks.fail('sweep', f'--sweep_dir={FLAGS.sweep_dir} is a file; valid: a directory (the '
                    'cells train in its subdirectories)')
  try:
    results = sweep_runner.run_sweep(FLAGS.sweep, FLAGS.sweep_dir, seeds=FLAGS.seeds,
                                     dry_run=FLAGS.dry_run, parallel=FLAGS.parallel,
                                     run_eval=FLAGS.sweep_eval, tune=FLAGS.tune,
                                     tune_tolerance=FLAGS.tune_tolerance)
  except sweep_spec.SweepError as e:
    cli_checks.fail('sweep error', e)
  except sweep_runner.SweepBusy as e:
    cli_checks.fail('sweep', e)
  except sweep_runner.Stopped as e:
    sys.exit(128 + e.signum)  # the shell's convention for "ended by this signal"
  sys.exit(0 if all(r in FINISHED for r in results.values()) else 1)


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli_checks.flags_parser('sweep'))
