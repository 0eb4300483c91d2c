"""Evaluation shared by the training loop and eval.py: summed metrics over a split, and a whole
run's evaluation (loss and perplexity per split, translation, length extrapolation, passkey
retrieval, mqar recall)."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from data import pipeline
from layers import attention
from layers import positions as positions_lib
import models
from training import checkpointing
from training import distributed
from training import extrapolation
from training import paths
from training import recall
from training import retrieval
from training import state as state_lib
from training import steps
from training import translation
from training import validation_passkey


RANDOM_IDS_SEED = 0  # the fixed key of a randomized-positions run's evaluation ids


def evaluate(eval_fn, variables, config, split, num_batches, length=None):
  """Mean loss/accuracy over the first `num_batches` batches (0 = all) of `split`, in order."""
  return steps.finalize(evaluate_sums(eval_fn, variables, config, split, num_batches, length))


def evaluate_sums(eval_fn, variables, config, split, num_batches, length=None, share=(0, 1)):
  """The summed metrics of `evaluate`; with `share` = (i, n), only of batches i, i + n, ... (one
  process's part of a split that n processes evaluate side by side; their sums add up)."""
  it = pipeline.make_iterator(config.data, split, config.train.batch_size,
                              batch_format=models.batch_format(config.model.arch),
                              loss_on=config.train.loss_on, shuffle=False, repeat=False,
                              drop_remainder=False, length=length)
  index, count = share
  total = {'loss_sum': 0.0, 'correct_sum': 0.0, 'weight_sum': 0.0}
  random_max = config.model.get('random_positions_max', 0)
  for i, batch in enumerate(it):
    if num_batches and i >= num_batches:
      break
    if i % count == index:
      if random_max:
        batch = random_ids(batch, i, random_max)
      total = jax.tree.map(jnp.add, total, eval_fn(variables, batch))
  return total


def random_ids(batch, index, max_position):
  """A randomized-positions run's evaluation batch at sorted random ids from [0, N), as it trains
  (Ruoss et al.), drawn with a fixed key folded with the batch's index: every evaluation of every
  run sees the same ids, so validation losses (and `tools.sweep --tune`) compare the model on
  inputs like its training's rather than at ids 0..T-1 it rarely saw."""
  key = jax.random.fold_in(jax.random.key(RANDOM_IDS_SEED), index)
  return {name: (np.asarray(positions_lib.random_positions(key, value, max_position))
                 if name.endswith('positions') else value) for name, value in batch.items()}


def load_run(workdir):
  """Returns (config, graphdef, variables, step) of the newest checkpoint in `workdir`, where
  `nnx.merge(graphdef, variables)` is the model (parameters and buffers in one `nnx.State`)."""
  path = paths.join(workdir, 'config.json')
  if not paths.exists(path):
    raise FileNotFoundError(f'eval: {workdir} has no config.json; is it a train.py workdir?')
  config = ml_collections.ConfigDict(paths.read_json(path))
  kernel = attention.KERNELS.get(config.model.get('attention_impl', attention.DEFAULT_KERNEL))
  if kernel is not None and kernel.single_device:
    # A kernel that needs the training mesh: eval runs on one device, where the kernel it declares
    # computes the same exact attention.
    config.model.attention_impl = kernel.single_device
  mngr = checkpointing.checkpoint_manager(workdir, config)
  if mngr.latest_step() is None:
    raise FileNotFoundError(f'eval: no checkpoint in {paths.join(workdir, "checkpoints")}')
  tokenizer = pipeline.get_tokenizer(config.data)
  graphdef, _, state = state_lib.create_state(
      config, state_lib.model_vocab_size(config, tokenizer.vocab_size),
      special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  # A run may be training here: its newest checkpoint may vanish (rotation) between the listing
  # and the restore, or be damaged. Take the newest that restores; eval never moves one aside.
  for attempt in range(3):
    mngr.reload()
    try:
      restored = checkpointing.restore_newest_good(mngr, state, workdir, move_aside=False)
      break
    except checkpointing.UnreadableCheckpoints:
      if attempt == 2 or mngr.all_steps() == []:
        raise
  mngr.close()
  if restored is None:
    raise FileNotFoundError(f'eval: no checkpoint in {paths.join(workdir, "checkpoints")}')
  state = restored[0]
  graphdef, variables = nnx.split(nnx.merge(graphdef, *state_lib.model_variables(state)))
  return config, graphdef, variables, int(state['step'])


def parse_rope_scaling(text):
  """'ntk:4' -> ('ntk', 4.0); 'none' -> ('none', 1.0)."""
  name, _, factor = text.partition(':')
  return name, float(factor) if factor else 1.0


def eval_options(rope_scaling=None, xpos_block=None):
  """eval.py's flags that change the position method of a trained model, as the `config.model`
  fields each sets: {flag as given: {field: value}} (empty: the model as trained)."""
  out = {}
  if rope_scaling is not None:
    name, factor = parse_rope_scaling(rope_scaling)
    out[f'--rope_scaling={rope_scaling}'] = {'rope_scaling': name, 'rope_scaling_factor': factor}
  if xpos_block is not None:
    out[f'--xpos_block={xpos_block}'] = {'xpos_block': xpos_block}
  return out


def _check_lengths(config, model, lengths):
  """Raises ValueError, before anything compiles, for --lengths the run cannot take (an arch that
  is not a causal LM, `models.contract.ArchSpec.causal_lm`; a learned table shorter than a
  length); returns a passkey run's retrieval lengths in tokens (its default 1, 2, 4, 8 x L when
  `lengths` is empty), else []."""
  spec = models.spec(config.model.arch)
  if lengths and not spec.causal_lm:
    valid = ', '.join(models.archs_where(lambda s: s.causal_lm))
    raise ValueError(f'--lengths (stream extrapolation) needs a {valid} run, not '
                     f'{config.model.arch!r}')
  passkey_lengths = (validation_passkey.retrieval_lengths(config, lengths)
                     if retrieval.is_passkey(config) else [])
  for length in passkey_lengths or [int(m * config.data.max_length) for m in lengths]:
    getattr(model, spec.decoder).position.check_length(length)
  return passkey_lengths


def _split_metrics(eval_fn, params, config, splits):
  """{'loss', 'perplexity', 'accuracy'}: {split: value} over every batch of each split, each
  process evaluating its share."""
  out = {'loss': {}, 'perplexity': {}, 'accuracy': {}}
  for split in splits:
    m = steps.finalize(distributed.gather_sums(evaluate_sums(
        eval_fn, params, config, split, 0, share=(jax.process_index(), jax.process_count()))))
    out['loss'][split] = m['loss']
    out['perplexity'][split] = math.exp(min(m['loss'], 50.0))
    out['accuracy'][split] = m['accuracy']
  return out


class Run:
  """What `evaluate_run` evaluated, for the pictures drawn afterwards (tools.plots)."""

  def __init__(self, config, model, tokenizer, per_position):
    self.config, self.model, self.tokenizer = config, model, tokenizer
    self.per_position = per_position  # {length: mean loss per window position} or {}


def evaluate_run(workdir, splits, max_examples=0, *, translate_splits=(), lengths=(),
                 modes=('non_overlapping', 'sliding'), stride=0.5, stream_split='test',
                 stream_tokens=0, rope_scaling=None, decode=None,
                 retrieval_examples=retrieval.DEFAULT_EXAMPLES,
                 position_ids='sequential', xpos_block=None):
  """Evaluates the newest checkpoint in `workdir`; returns (the eval.json dict, a `Run`).

  Every process evaluates its share of the batches, sentences and windows; the shares are
  gathered in process order, so every process holds the whole result. Nothing is written here:
  eval.py writes eval.json and the pictures from process 0.

  Args:
    workdir: a train.py workdir.
    splits: splits for loss/perplexity and translation.
    max_examples: translate at most this many examples per split (0 = all).
    translate_splits: further splits for translation only (longer sentences; no loss).
    lengths: extrapolation multiples of the training length (empty = none); for a passkey run the
      retrieval report's (empty = 1, 2, 4, 8).
    modes, stride, stream_split, stream_tokens: see `training.extrapolation.extrapolate`.
    rope_scaling: None or e.g. 'ntk:4', applied at evaluation only.
    decode: None (greedy) or a dict of `models.decoding.generate` options, e.g.
      {'method': 'beam', 'num_beams': 4, 'length_penalty': 0.6}.
    retrieval_examples: a passkey run's examples per length and depth.
    position_ids: the ids of the stream windows, or of a passkey run's retrieval rows
      (`training.extrapolation.POSITION_IDS`).
    xpos_block: None (as trained), or xPos's blockwise causal block at evaluation (0: plain
      causal attention).
  """
  config, graphdef, params, step = load_run(workdir)
  tokenizer = pipeline.get_tokenizer(config.data)
  model = nnx.merge(graphdef, params)
  overrides = eval_options(rope_scaling, xpos_block)
  if overrides:  # the fields each flag changes, applied to the built model's position method
    changed = config.model.copy_and_resolve_references()
    for fields in overrides.values():
      changed.update(fields)
    for fields in overrides.values():
      positions_lib.set_eval_options(model, changed, tuple(fields))
    graphdef, params = nnx.split(model)
  passkey_lengths = _check_lengths(config, model, lengths)
  decode = dict(decode or {})
  eval_fn = jax.jit(functools.partial(steps.eval_step, graphdef))
  result = {'step': step, **_split_metrics(eval_fn, params, config, splits), 'translation': {}}
  if xpos_block is not None:  # every number below is of the model with this block
    result['xpos_block'] = xpos_block
  if config.model.get('random_positions_max', 0):  # the split losses' ids (`random_ids`)
    result['split_position_ids'] = 'random (sorted, fixed key)'
  # text_lm documents have no target to translate (an explicit --translate says so in one line).
  scored = list(splits) if pipeline.has_pairs(config.data) else []
  for split in scored + [s for s in translate_splits if s not in splits]:
    examples = pipeline.load_examples(config.data, split)
    if max_examples:
      examples = examples[:max_examples]
    result['translation'][split] = translation.translate(config, model, examples, tokenizer,
                                                         **decode)
  per_position = {}
  if passkey_lengths:
    result['rope_scaling'] = rope_scaling or 'as trained'
    result['position_ids'] = position_ids
    result['retrieval'] = retrieval.retrieval(config, model, tokenizer, passkey_lengths,
                                              examples=retrieval_examples,
                                              position_ids=position_ids)
    result['retrieval_examples'] = retrieval_examples
  elif lengths:
    result['rope_scaling'] = rope_scaling or 'as trained'
    result['position_ids'] = position_ids
    result['extrapolation'], per_position = extrapolation.extrapolate(
        config, model, lengths, modes, stride, stream_split, position_ids, stream_tokens)
    if stream_tokens:
      result['stream_tokens'] = stream_tokens
    # Kept for tools.compare's per-position picture with seed bands: {length: loss per position}.
    result['extrapolation_per_position'] = {
        str(n): [round(float(x), 5) for x in curve] for n, curve in per_position.items()}
  if recall.is_mqar(config):
    result['recall'] = recall.recall(config, model, tokenizer)
  main_split = 'test' if 'test' in splits else splits[-1]
  if main_split in result['translation']:
    result['exact_match'] = result['translation'][main_split]['exact_match']
    result['token_accuracy'] = result['translation'][main_split]['token_accuracy']
  return result, Run(config, model, tokenizer, per_position)
