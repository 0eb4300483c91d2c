"""Compares train.py runs: overlaid loss curves (PNG), divergence/plateau flags, a markdown table.

    python -m tools.compare DIR [DIR ...] [--out=PNG] [--smooth=ema:0.9] [--logy] [--logx]
        [--target_loss=3.0 [--target_split=train]] [--color_by=FIELD] [--style_by=FIELD]
        [--band=minmax|std|none] [--metrics=moe_drop_fraction,moe_load_cv] [--baseline=CELL]

Runs are workdirs (metrics.jsonl, config.json, run_info.json); a sweep directory stands for every
workdir inside it. Runs whose configs differ only in `train.seed` form one group, drawn as the mean
across seeds with a band (min-max by default). The table names each group by its full overrides;
the picture's one legend (outside the panels) by the fields that differ, abbreviated
(`post · 12L · lr 1e-3 · no warmup · plateau`, at most about 40 characters: beyond that each
field's most common value is left out and named once in the legend's title). The colour follows
one field (--color_by; by default the one with the fewest values, the study's main contrast among
equals), the line style another (--style_by), and the other differing fields the shade of the
colour.

A tuned sweep's directory (`tools.sweep --tune`, its choices in tune.json) is compared at each
cell's chosen value, shown in the table's `chosen` column; a second table lists the final
validation loss of every tuning run, cell x value (tools/compare/tune_table.py). Runs evaluated by
eval.py add their tables: loss by length (--lengths, tools/compare/extrapolation.py) and passkey
retrieval accuracy by length, with every cell's heat map in OUT_retrieval.png
(tools/compare/retrieval.py).

Statistics (tools/compare/stats.py, tools/compare/significance.py): every cell's final validation
loss and eval.json metrics as a mean with a 95% interval across seeds (t; for accuracy, retrieval
and recall a bootstrap one inside [0, 1], with the seeds solved), in a table and in
OUT_stats.json; with --baseline=CELL (a cell's name as the table prints it) a permutation test of
every cell against it, the sign-flip test paired by seed where both ran the same seeds, else the
two-sample one, Holm's correction over the table, and a verdict at 5% of the corrected p:
better, worse or n.s. (with the minimum detectable effect). The final validation loss's verdict
also reads in the picture's legend; OUT_intervals.png draws each cell's mean and interval as a
dot, coloured by its verdict (tools/compare/stats_figure.py).

A ladder sweep (tools.sweep's 'ladder', its SWEEP_DIR/ladder.json) takes --baseline=VARIANT (the
variant's overrides without size and budget, e.g. model.attention=dense) and adds the ladder's
table, OUT_ladder.json and OUT_ladder.png: each variant's compute-optimal frontier, its fitted
L(C) = E + A·C^-alpha, its effective-compute multiplier against the baseline with a bootstrap 95%
interval, and verdicts per budget (Holm over the ladder) and overall (better or worse only when
every budget agrees, budget-dependent when they disagree); tools/compare/ladder.py.

Flags (on the raw train loss of each run, documented in the table's footnote):
- diverged: a non-finite loss, or a spike: after the first 10% of the run's steps, a train loss
  above 2x the running minimum of the train losses logged so far.
- plateaued: not diverged, the final train loss is within 5% of the train loss at 25% of the run
  (>= 0.95x it), and it is above 0.9x the unigram entropy of the training tokens (run_info.json;
  the loss of a model that learned token frequencies only). Without that entropy the level is half
  the first logged train loss.
"""

import sys

from absl import app
from absl import flags

from training import paths as paths_lib  # local or gs:// (the arguments are `paths` here)
from tools.compare import comparison

FLAGS = flags.FLAGS


def define_flags():
  """The CLI flags, defined only when run as a program (importing the package defines none)."""
  flags.DEFINE_string('smooth', None, 'Train-curve smoothing: ema:BETA (or BETA), ma:K, or none.')
  flags.DEFINE_bool('logy', False, 'Log-scale loss axis.')
  flags.DEFINE_bool('logx', False, 'Log-scale step axis.')
  flags.DEFINE_float('target_loss', None, 'Report the first logged step whose loss (see '
                     '--target_split) is at most this.')
  flags.DEFINE_enum('target_split', 'valid', ['valid', 'train'], 'The loss --target_loss reads: '
                    'validation (every eval_every steps) or training (every log_every steps).')
  flags.DEFINE_string('out', None, 'The PNG to write, local or gs:// (default: '
                      'DIR/compare.png of the first DIR).')
  flags.DEFINE_string('color_by', None, 'The config field whose values pick the colour (e.g. '
                      'model.norm_position, or its last part); default: the field with the fewest '
                      'values that still separates the runs; none: one colour per group.')
  flags.DEFINE_string('style_by', None, 'The config field (at most 4 values) whose values pick '
                      'the line style (e.g. model.num_layers); default: the next such field when '
                      'colour alone does not tell the groups apart; none: solid lines.')
  flags.DEFINE_list('metrics', [], 'Logged training metrics to draw over training beside the '
                    'loss (OUT_metrics.png) and tabulate, e.g. moe_drop_fraction,moe_load_cv; '
                    'a per-layer diagnostic bare (attn_sink_share) is its mean over the layers.')
  flags.DEFINE_string('baseline', None, 'A cell\'s name as the table prints it (its overrides '
                      'without the seed; a ladder sweep\'s: a variant): every other cell gets a '
                      'verdict against it, better, worse or n.s. at 5% after Holm\'s correction '
                      'over the table (sign-flip permutation test paired by seed, else a '
                      'two-sample permutation test).')
  flags.DEFINE_string('band', 'minmax', 'The band around each group\'s mean across seeds: minmax, '
                      'std (mean -/+ one standard deviation) or none.')


def main(argv):
  """Prints the table and `wrote OUT`; exits 2 on a missing run or a bad option."""
  # Positional arguments, not a comma-separated flag: cell workdirs have commas in their names.
  paths = argv[1:]
  if not paths:
    print('compare: name at least one workdir or sweep directory: python -m tools.compare DIR '
          '[DIR ...]', file=sys.stderr)
    sys.exit(2)
  out = FLAGS.out or paths_lib.join(paths[0], 'compare.png')
  try:
    table = comparison.compare(
        paths, out, smoothing=FLAGS.smooth, logy=FLAGS.logy, logx=FLAGS.logx,
        target_loss=FLAGS.target_loss, target_split=FLAGS.target_split, color_by=FLAGS.color_by,
        style_by=FLAGS.style_by, band_kind=FLAGS.band, metrics=FLAGS.metrics,
        baseline=FLAGS.baseline)
  except (FileNotFoundError, ValueError) as e:
    print(str(e), file=sys.stderr)
    sys.exit(2)
  print(table)
  print(f'\nwrote {out}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
