"""Evaluates the newest checkpoint of a run: `python eval.py --workdir=DIR`.

Writes DIR/eval.json (loss and perplexity per split, greedy translation exact match and token
accuracy; a passkey run's retrieval accuracy per length and depth, drawn in DIR/retrieval.png) and
DIR/loss_curve.png (train and validation loss from metrics.jsonl). The work is done by
`training.evaluation` and the pictures by `tools.plots`; this file holds the flags and main.
"""

import json
import os
import sys

from training import host

# Evaluation writes eval.json only when it completes: a signal at any moment is one line.
host.die_with_parent()  # a sweep cell goes when its runner does
host.exit_at_once_on_signals('eval', 'before it completed; eval.json is not written')
host.cpu_when_no_accelerator()  # before JAX starts


from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import jax  # noqa: E402

from layers import options  # noqa: E402
from tools.plots import run_pictures as plots  # noqa: E402
from training import checkpointing  # noqa: E402
from training import cli_checks  # noqa: E402
from training import eval_checks  # noqa: E402
from training import distributed  # noqa: E402
from training import evaluation  # noqa: E402
from training import extrapolation  # noqa: E402
from training import paths  # noqa: E402
from training import quiet  # noqa: E402
from training import recall  # noqa: E402
from training import retrieval  # noqa: E402

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir (a local path or gs://).')
_SPLIT = flags.DEFINE_list('split', ['validation', 'test'], 'Splits to evaluate.')
_MAX_EXAMPLES = flags.DEFINE_integer('max_examples', 0,
                                     'Translate at most this many examples per split (0 = all).')
_TRANSLATE = flags.DEFINE_list('translate', [], 'Extra splits to translate only (e.g. test_long); '
                               'exact match is reported per source-length bucket.')
_LENGTHS = flags.DEFINE_list('lengths', [], 'Length extrapolation: evaluation lengths as multiples '
                             'of the training length, e.g. 1,2,4,8 (empty = skip; a passkey run: '
                             'the retrieval report\'s lengths, empty = 1,2,4,8).')
_MODES = flags.DEFINE_list('modes', ['non_overlapping', 'sliding'],
                           'Extrapolation windows: non_overlapping and/or sliding.')
_STRIDE = flags.DEFINE_float('stride', 0.5, 'Sliding-window stride as a fraction of the window.')
_STREAM_SPLIT = flags.DEFINE_string('stream_split', 'test', 'Split streamed for extrapolation.')
_STREAM_TOKENS = flags.DEFINE_integer('stream_tokens', 0, 'Extrapolation: evaluate the first this '
                                      'many tokens of the stream (0 = all of it).')
_DECODE = flags.DEFINE_enum('decode', 'greedy', ['greedy', 'beam', 'sample'],
                            'Translation decoding (KV cache): greedy, beam or sample.')
_NUM_BEAMS = flags.DEFINE_integer('num_beams', 4, 'Beam width (--decode=beam).')
_LENGTH_PENALTY = flags.DEFINE_float('length_penalty', 0.6, 'GNMT length penalty alpha (beam).')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature (--decode=sample).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens (0 = all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass (1.0 = off).')
_PLOT_ATTENTION = flags.DEFINE_integer('plot_attention', 0, 'Draw attention heat maps (one panel '
                                       'per head) of this many test sentences (0 = none).')
_RETRIEVAL_EXAMPLES = flags.DEFINE_integer('retrieval_examples', retrieval.DEFAULT_EXAMPLES,
                                          'A passkey run: examples per length and depth of the '
                                          'retrieval report.')
_ROPE_SCALING = flags.DEFINE_string('rope_scaling', None, 'Override RoPE scaling at evaluation '
                                    'only: none, pi:F, ntk:F, yarn:F, llama3:F or dynamic:F (F the '
                                    'factor).')
_POSITION_IDS = flags.DEFINE_enum('position_ids', 'sequential', list(extrapolation.POSITION_IDS),
                                  '--lengths windows (or a passkey run\'s retrieval rows) at '
                                  'ids 0..T-1 (sequential), or, for a model.random_positions_max=N '
                                  'run, at sorted draws from [0, N) as in its training (random) '
                                  'or spread evenly over it (spaced).')
_XPOS_BLOCK = flags.DEFINE_integer('xpos_block', None, 'An xPos run evaluated with blockwise '
                                   'causal attention of this block (0 = plain causal); default: '
                                   'as trained.')
# Comparing runs moved to its own tool; the old flag names the new command.
_COMPARE = flags.DEFINE_list('compare', [], 'Moved: use `python -m tools.compare DIR [DIR ...]`.')
for _name, _define in (('smooth', flags.DEFINE_string), ('logy', flags.DEFINE_bool),
                       ('logx', flags.DEFINE_bool), ('target_loss', flags.DEFINE_float),
                       ('out', flags.DEFINE_string)):
  _define(_name, None, 'Moved to `python -m tools.compare`.')
distributed.define_distributed_flags()
host.define_host_malloc_flag()


def _decode_options():
  """The --decode flags as `models.decoding.generate` options (None = plain greedy)."""
  if _DECODE.value == 'greedy':
    return None
  if _DECODE.value == 'beam':
    return {'method': 'beam', 'num_beams': _NUM_BEAMS.value,
            'length_penalty': _LENGTH_PENALTY.value}
  return {'method': 'sample', 'temperature': _TEMPERATURE.value, 'top_k': _TOP_K.value,
          'top_p': _TOP_P.value}


def print_summary(result, splits):
  """One line per split (loss only where it was computed) and per extrapolation row."""
  for split in splits or list(result['loss']):  # text_lm runs translate nothing: loss lines only
    t = result['translation'].get(split)
    # --translate splits are decoded only (no loss pass over them).
    loss = (f'loss {result["loss"][split]:.4f}  ppl {result["perplexity"][split]:.3f}  '
            if split in result['loss'] else '')
    if t is None:
      if split in result.get('accuracy', {}):  # tokens predicted exactly (MQAR's headline)
        loss += f'accuracy {100 * result["accuracy"][split]:.1f}%'
      print(f'{split}: {loss.strip()}')
      continue
    print(f'{split}: {loss}exact_match {t["exact_match"]:.4f}  token_accuracy '
          f'{t["token_accuracy"]:.4f}  bleu {t["bleu"]:.2f}  (n={t["n"]})')
  for line in (retrieval.summary_lines(result.get('retrieval', {}))
               + recall.summary_lines(result.get('recall', {}))):
    print(line)
  for row in result.get('extrapolation', []):
    print(f'extrapolation x{row["multiple"]:g} L={row["length"]} {row["mode"]}: loss '
          f'{row["loss"]:.4f} (target tokens alone: {row["target_loss"]:.4f})  ppl '
          f'{row["ppl"]:.3f}')


def check_flags():
  """Every flag checked before anything is restored or compiled (one line, exit 2); returns the
  --lengths multiples as floats."""
  lengths = eval_checks.check_eval_flags(
      split=_SPLIT.value, max_examples=_MAX_EXAMPLES.value, lengths=_LENGTHS.value,
      modes=_MODES.value, stride=_STRIDE.value, num_beams=_NUM_BEAMS.value,
      length_penalty=_LENGTH_PENALTY.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
      top_p=_TOP_P.value, plot_attention=_PLOT_ATTENTION.value, rope_scaling=_ROPE_SCALING.value,
      retrieval_examples=_RETRIEVAL_EXAMPLES.value, stream_tokens=_STREAM_TOKENS.value)
  eval_checks.check_eval_run(_WORKDIR.value, split=_SPLIT.value, translate=_TRANSLATE.value,
                            lengths=lengths, stream_split=_STREAM_SPLIT.value,
                            stream_tokens=_STREAM_TOKENS.value,
                            rope_scaling=_ROPE_SCALING.value, plot_attention=_PLOT_ATTENTION.value,
                            decode=_DECODE.value, max_examples=_MAX_EXAMPLES.value,
                            position_ids=_POSITION_IDS.value, xpos_block=_XPOS_BLOCK.value)
  if jax.process_index() == 0 and not paths.is_remote(_WORKDIR.value) and os.path.isdir(
      _WORKDIR.value):  # a local probe file; a gs:// workdir is written by the run's own writes
    eval_checks.check_can_write(_WORKDIR.value, 'eval.json')  # before hours of evaluation
  return lengths


def main(argv):
  if len(argv) > 1:
    cli_checks.fail('eval', f'unexpected arguments {argv[1:]}; valid: flags only')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
  quiet.drop_harmless_warnings()  # ... and a few warnings that need no action
  if _COMPARE.value:
    others = [a for a in sys.argv[1:] if not a.startswith('--compare')]
    print('eval: comparing runs moved to its own tool; run: python -m tools.compare '
          + ' '.join(_COMPARE.value + others), file=sys.stderr)
    sys.exit(2)
  if host.host_malloc_wanted(flags.FLAGS.host_malloc):
    host.tune_host_malloc()
  try:
    cli_checks.check_workdir(_WORKDIR.value, 'a train.py workdir')
    paths.check_store_reachable(_WORKDIR.value, '--workdir')
    distributed.init_distributed(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                                 flags.FLAGS.process_id, flags.FLAGS.multihost)
    lengths = check_flags()
  except options.ConfigError as e:
    cli_checks.fail('eval', e)
  except paths.StoreUnreachable as e:
    cli_checks.fail('eval', e, status=1)
  splits = _SPLIT.value
  try:
    result, run = evaluation.evaluate_run(
        _WORKDIR.value, splits, _MAX_EXAMPLES.value, translate_splits=_TRANSLATE.value,
        lengths=lengths, modes=_MODES.value, stride=_STRIDE.value,
        stream_split=_STREAM_SPLIT.value, stream_tokens=_STREAM_TOKENS.value,
        rope_scaling=_ROPE_SCALING.value, position_ids=_POSITION_IDS.value,
        xpos_block=_XPOS_BLOCK.value,
        decode=_decode_options(), retrieval_examples=_RETRIEVAL_EXAMPLES.value)
  except ValueError as e:
    cli_checks.fail('eval', e)
  except (FileNotFoundError, checkpointing.RunFailed) as e:  # no checkpoint, or none readable
    print(f'eval: {e}' if isinstance(e, checkpointing.RunFailed) else str(e), file=sys.stderr)
    sys.exit(1)
  if jax.process_index() > 0:  # process 0 writes the results and draws the pictures
    return
  print_summary(result, list(result['translation']))  # the results reach stdout whatever follows
  try:
    plots.write_eval_outputs(_WORKDIR.value, result, run, splits, _PLOT_ATTENTION.value)
  except OSError as e:
    print(json.dumps(result, default=str))  # the whole eval.json, so that nothing is lost
    cli_checks.fail('eval', f'could not write the results in {_WORKDIR.value} ({e}); they are '
                    'printed above as JSON', status=1)
  pictures = [result[k] for k in ('retrieval_plot', 'loss_curve') if k in result]
  print(f'wrote {paths.join(_WORKDIR.value, "eval.json")} and {" and ".join(pictures)}')


if __name__ == '__main__':
  app.run(main, flags_parser=cli_checks.flags_parser('eval'))
