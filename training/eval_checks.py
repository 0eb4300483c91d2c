"""eval.py's input checks: its flags (`check_eval_flags`) and the flags against the run's
config.json (`check_eval_run`), each bad input one line naming the flag and what is valid, before
anything is restored or compiled; and a real write probe of the workdir (`check_can_write`)."""

import math
import os
import tempfile

import ml_collections

import models
from data import pipeline
from data import text_corpus
from layers.options import ConfigError
from layers import rope
from training import evaluation
from training import extrapolation
from training import paths
from training import train_checks
from training import validation
from training import validation_attention
from training import validation_passkey
from training import validation_positions


def _finite(value):
  return isinstance(value, (int, float)) and math.isfinite(value)


def parse_lengths(texts):
  """--lengths as floats: each a finite number > 0."""
  out = []
  for text in texts:
    try:
      value = float(text)
    except ValueError:
      value = None
    if value is None or not _finite(value) or value <= 0:
      raise ConfigError(f'--lengths={",".join(texts)}: {text!r} is not valid; valid: positive '
                        'multiples of the training length, e.g. 1,2,4,8')
    out.append(value)
  return out


def check_eval_flags(*, split, max_examples, lengths, modes, stride, num_beams, length_penalty,
                     temperature, top_k, top_p, plot_attention, rope_scaling,
                     retrieval_examples=1, stream_tokens=0):
  """eval.py's flags on their own (the run's config is not needed); returns --lengths as floats.

  `--temperature=0` is refused, not read as greedy: sampling divides the logits by it; greedy
  decoding is `--decode=greedy`.
  """
  if not split or not all(s.strip() for s in split):
    raise ConfigError(f'--split={",".join(split)} names an empty split; valid: one or more of '
                      'validation, test, test_long, test_xlong, train')
  if max_examples < 0:
    raise ConfigError(f'--max_examples={max_examples} must be >= 0 (0 = all)')
  if stream_tokens < 0:
    raise ConfigError(f'--stream_tokens={stream_tokens} must be >= 0 (0 = the whole stream)')
  lengths = parse_lengths(lengths)
  bad = [m for m in modes if m not in ('non_overlapping', 'sliding')]
  if bad or (lengths and not modes):
    raise ConfigError(f'--modes={",".join(modes)} is not valid; valid: non_overlapping, sliding')
  if not _finite(stride) or not 0 < stride <= 1:
    raise ConfigError(f'--stride={stride} must be in (0, 1] (a fraction of the window)')
  if num_beams < 1:
    raise ConfigError(f'--num_beams={num_beams} must be a positive integer')
  if not _finite(length_penalty) or length_penalty < 0:
    raise ConfigError(f'--length_penalty={length_penalty} must be a finite number >= 0')
  if not _finite(temperature) or temperature <= 0:
    raise ConfigError(f'--temperature={temperature} is refused: '
                      'sampling needs a finite temperature '
                      '> 0; for greedy decoding use --decode=greedy')
  if top_k < 0:
    raise ConfigError(f'--top_k={top_k} must be >= 0 (0 = all tokens)')
  if not _finite(top_p) or not 0 < top_p <= 1:
    raise ConfigError(f'--top_p={top_p} must be in (0, 1] (1 = off)')
  if plot_attention < 0:
    raise ConfigError(f'--plot_attention={plot_attention} must be >= 0 (0 = none)')
  if retrieval_examples < 1:
    raise ConfigError(f'--retrieval_examples={retrieval_examples} must be a positive integer')
  if rope_scaling is not None:
    name, colon, factor = rope_scaling.partition(':')
    try:
      value = float(factor) if colon else 1.0
    except ValueError:
      value = None
    if name not in rope.SCALINGS or value is None or not _finite(value) or value < 1 or (
        name != 'none' and not colon):
      scalings = ', '.join(f'{name}:F' for name in rope.SCALINGS if name != 'none')
      raise ConfigError(f'--rope_scaling={rope_scaling} is not valid; valid: none, or {scalings} '
                        'with a factor F >= 1')
  return lengths


def _run_config(workdir):
  path = paths.join(workdir, 'config.json')  # local or gs://
  if not paths.exists(path):
    return None  # evaluation says so itself (no config.json: not a train.py workdir)
  try:
    return ml_collections.ConfigDict(paths.read_json(path))
  except ValueError as e:  # json.JSONDecodeError: a damaged file
    raise ConfigError(f'{path} is damaged ({e}); rerun the run\'s train.py command to rewrite '
                      'it (it resumes from the checkpoint)') from None


def _check_documents_flags(task, *, translate, plot_attention, decode, max_examples):
  """Flags that work on sentence pairs, refused for a run on documents (data.task=text_lm),
  passkey prompts or synthetic task rows."""
  holds = {'text_lm': 'documents', 'python_code': 'documents',
           'passkey': 'retrieval prompts'}.get(task, 'synthetic task rows')
  why = f'data.task={task!r} holds {holds}, not sentence pairs'
  if translate:
    raise ConfigError(f'--translate={",".join(translate)} decodes target sentences; {why}; valid: '
                      'leave it out (loss and perplexity per --split, and --lengths)')
  if plot_attention:
    raise ConfigError(f'--plot_attention={plot_attention} draws a pair\'s target-to-source '
                      f'attention; {why}; valid: 0')
  if decode != 'greedy':
    raise ConfigError(f'--decode={decode} chooses how translations are decoded; {why}, so nothing '
                      'is decoded; valid: greedy (the default)')
  if max_examples:
    raise ConfigError(f'--max_examples={max_examples} limits the examples translated; {why}, so '
                      'nothing is translated; valid: 0')


def check_eval_run(workdir, *, split, translate, lengths, stream_split, rope_scaling,
                   stream_tokens=0, plot_attention=0, decode='greedy', max_examples=0,
                   position_ids='sequential',
                   xpos_block=None):
  """eval.py's flags against the run's config.json: the input files unchanged since training (text
  tasks), split names, the flags a text_lm or passkey run cannot use, and --lengths within what
  the model can embed (a learned table has data.max_length rows) and the stream can fill (a
  passkey run: its retrieval lengths, 1, 2, 4, 8 x L by default)."""
  config = _run_config(workdir)
  if config is None:
    return
  try:
    train_checks.check_corpus(config, workdir)  # first: the checks below may prepare the stream
  except text_corpus.DataError as e:
    raise ConfigError(str(e)) from None
  if not pipeline.has_pairs(config.data):
    _check_documents_flags(config.data.task, translate=translate, plot_attention=plot_attention,
                           decode=decode, max_examples=max_examples)
  names = pipeline.split_names(config.data)
  for flag, values in (('--split', split), ('--translate', translate),
                       ('--stream_split', [stream_split] if lengths else [])):
    bad = [s for s in values if s not in names]
    if bad:
      raise ConfigError(f'{flag}={",".join(values)}: {bad[0]!r} is not a split of this run; valid: '
                        f'{", ".join(names)}')
  if translate:
    validation_attention.check_decoding(config.model, f'--translate={",".join(translate)}')
  elif pipeline.has_pairs(config.data):
    validation_attention.check_decoding(config.model, f'eval.py (it translates --split='
                                        f'{",".join(split)})')
  _check_position_overrides(config, lengths, position_ids, rope_scaling, xpos_block)
  if config.data.get('task') == 'passkey':
    validation_passkey.retrieval_lengths(config, lengths)
    return
  if not lengths:
    return
  if not models.spec(config.model.arch).causal_lm:
    valid = ', '.join(models.archs_where(lambda s: s.causal_lm))
    raise ConfigError(f'--lengths (stream extrapolation) needs a {valid} run, not '
                      f'{config.model.arch!r}')
  train_length = config.data.max_length
  rows = validation_positions.max_positions(config)
  stream = len(pipeline.stream_tokens(config.data, stream_split)[0])
  if stream_tokens:
    stream = min(stream, stream_tokens)
  for multiple in lengths:
    length = int(multiple * train_length)
    if length < 1:
      raise ConfigError(f'--lengths: {multiple:g} x data.max_length={train_length} is under one '
                        f'token; valid: multiples >= {1 / train_length:g}')
    if rows is not None and length > rows:
      raise ConfigError(f'--lengths: {multiple:g} x data.max_length={train_length} = {length} '
                        f'positions; the run\'s position={config.model.position} table has '
                        f'max_length={rows} rows; valid: multiples <= {rows / train_length:g}')
    if length >= stream:
      raise ConfigError(f'--lengths: {multiple:g} x data.max_length={train_length} = {length} '
                        f'tokens, longer than the {stream_split!r} stream ({stream} tokens'
                        f'{" kept by --stream_tokens" if stream_tokens else ""}); valid: '
                        f'multiples <= {(stream - 1) // train_length}')


def _check_position_overrides(config, lengths, position_ids, rope_scaling, xpos_block):
  """--position_ids (stream windows of a randomized-positions run), and the flags that change the
  position method at evaluation (`evaluation.eval_options`: --rope_scaling, --xpos_block), each on
  a run whose method declares the fields it changes (`eval_options`), the changed config validated
  as a whole (e.g. an xPos block > 0 only where the run's kernel takes its mask)."""
  if position_ids != 'sequential':
    passkey_run = config.data.get('task') == 'passkey'
    if not lengths and not passkey_run:
      raise ConfigError(f'--position_ids={position_ids} sets the ids of the --lengths stream '
                        'windows or of a passkey run\'s retrieval rows; valid: with --lengths on a '
                        'stream run, or sequential')
    if passkey_run:  # the retrieval report's lengths, 1, 2, 4, 8 x L by default
      lengths = list(lengths) or list(validation_passkey.DEFAULT_MULTIPLES)
    try:
      extrapolation.check_position_ids(config, position_ids, lengths)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  if xpos_block is not None and xpos_block < 0:
    raise ConfigError(f'--xpos_block={xpos_block} must be an integer >= 0 (0 = plain causal)')
  for flag, fields in evaluation.eval_options(rope_scaling, xpos_block).items():
    validation_positions.check_eval_options(config, flag, fields)
    changed = ml_collections.ConfigDict(config.to_dict())
    changed.model.update(fields)
    try:
      validation.validate(validation.resolve(changed))
    except ConfigError as e:
      raise ConfigError(f'{flag}: {e}') from None


def check_can_write(workdir, name):
  """Raises ConfigError unless `name` can be written in `workdir`: a real write of a temporary
  file there, since permissions say nothing about a read-only mount (nor bind root)."""
  target = os.path.join(workdir, name)
  if os.path.isdir(target):
    raise ConfigError(f'{target} is a directory; {name} cannot be written there')
  try:
    fd, probe = tempfile.mkstemp(prefix=f'.{name}.', dir=workdir)
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f'cannot write {name} in {workdir} ({e.strerror}); nothing was evaluated; '
                      'valid: a writable workdir (copy the run elsewhere to evaluate it)') from None
