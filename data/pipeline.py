"""grain input pipeline: sentence pairs (the toy task, your TSV files), documents (your text
files), passkey prompts or synthetic task rows -> padded, packed or streamed batches of a batch
format (the row layout a model reads)."""

import collections
import functools

from absl import logging
import grain
import numpy as np
import tensorflow_datasets as tfds

from data import passkey
from data import passkey_text
from data import python_code
from data import remote_dir
from data import synthetic
from data import text_corpus
from data import tokenizer as tokenizer_lib
from data import toy_translation

BOS, EOS, SEP = tokenizer_lib.BOS, tokenizer_lib.EOS, tokenizer_lib.SEP
LOSS_ON = ('target', 'all')
# The toy task names, your own data, the generated passkey retrieval and synthetic tasks.
TASKS = (tuple(toy_translation.TASKS) + text_corpus.TASKS + (python_code.TASK, passkey.TASK)
         + synthetic.TASKS)
DOCUMENT_TASKS = ('text_lm', python_code.TASK)  # one document an example, no sentence pairs
DataError = text_corpus.DataError  # a bad input file or data setting (one line naming the file)
ToySource = collections.namedtuple('ToySource', 'task data_dir')


def _field(data_config, name, default):
  """Reads an optional data_config field (ConfigDict or dict)."""
  return data_config.get(name, default)



def _source(data_config):
  """The hashable identity of the configured corpus (the per-process caches are keyed by it): a
  ToySource, a text_corpus.CorpusSpec for data.task text_pairs / text_lm, or a
  passkey.PasskeySpec, or a synthetic.SyntheticSpec."""
  task = _field(data_config, 'task', 'base')
  _check('task', task, TASKS)
  if task in text_corpus.TASKS or task == python_code.TASK:
    return text_spec(data_config)
  if task == passkey.TASK:
    return passkey.spec_from_config(data_config)
  if task in synthetic.TASKS:
    return synthetic.spec_from_config(data_config)
  # A gs:// data_dir is read through a local mirror (data.remote_dir).
  return ToySource(task, remote_dir.local_data_dir(_field(data_config, 'data_dir', './tfds_data'),
                                                   task))


def text_spec(data_config):
  """The text_corpus.CorpusSpec of a text_pairs, text_lm or python_code config (the stdlib files
  written on first use), else None."""
  task = _field(data_config, 'task', 'base')
  if task == python_code.TASK:
    return python_code.spec_from_config(data_config)
  return text_corpus.spec_from_config(data_config) if task in text_corpus.TASKS else None


def is_text(source) -> bool:
  return isinstance(source, text_corpus.CorpusSpec)


def is_passkey(source) -> bool:
  return isinstance(source, passkey.PasskeySpec)


def is_synthetic(source) -> bool:
  return isinstance(source, synthetic.SyntheticSpec)


def has_pairs(data_config) -> bool:
  """Whether the task's examples are (source, target) pairs (translation can be scored); text_lm
  holds documents, passkey retrieval prompts (scored by `training.retrieval`), the synthetic
  tasks rows of tokens scored where they say."""
  task = _field(data_config, 'task', 'base')
  return task not in DOCUMENT_TASKS + (passkey.TASK,) + synthetic.TASKS


@functools.lru_cache(maxsize=None)
def _prepared(source) -> str:
  """Prepares the corpus once per process (reused from data_dir if there); its folder."""
  if is_text(source):
    return text_corpus.prepare(source)
  if is_passkey(source):
    return passkey.prepare(source)
  if is_synthetic(source):
    return synthetic.prepare(source)
  return toy_translation.prepare(source.data_dir, source.task)


@functools.lru_cache(maxsize=None)
def _tokenizer(source):
  if is_text(source):
    return text_corpus.load_tokenizer(_prepared(source))
  if is_passkey(source):
    return passkey.load_tokenizer(source)
  if is_synthetic(source):
    return synthetic.load_tokenizer(source)
  return toy_translation.load_tokenizer(source.data_dir, source.task)


def get_tokenizer(data_config):
  """Returns the task's tokenizer, preparing the dataset under data_config.data_dir on first use.

  Args:
    data_config: ConfigDict with `task` and `data_dir` (and for text_pairs / text_lm `files`,
      `vocab_size`, `shared_vocab`).

  Returns:
    The tokenizer saved next to the prepared dataset: `data.tokenizer.Tokenizer` for the toy task,
    `data.sentencepiece_tokenizer.SentencePieceTokenizer` for your own data,
    `data.hf_tokenizer.HFTokenizer` with data.tokenizer (same interface; its own special ids).

  Raises:
    DataError: a bad input file or vocab_size (text tasks), in one line.
  """
  return _tokenizer(_source(data_config))


def split_names(data_config) -> list[str]:
  """Returns the task's split names (train, validation and the test splits)."""
  source = _source(data_config)
  if is_text(source):
    return list(text_corpus.SPLITS)
  if is_passkey(source):
    return list(passkey.SPLITS)
  if is_synthetic(source):
    return list(synthetic.SPLITS)
  return list(toy_translation.TASKS[source.task].splits)


def _check_split(data_config, split):
  _check('split', split, split_names(data_config))


@functools.lru_cache(maxsize=None)
def _read_split(source, split: str) -> tuple[tuple[str, str], ...]:
  """Reads a whole split once per process: (source, target) strings in file order; a text_lm
  document is ('', text).

  The corpus is a few MB, so one bulk read through tfds.data_source (array_record, no TensorFlow)
  replaces a random-access read per example, which costs ~0.25 ms each in the TFDS decoder.
  """
  if is_text(source):
    return tuple(text_corpus.read_split(_prepared(source), split))
  if is_passkey(source):
    return tuple(passkey.read_split(source, split))
  if is_synthetic(source):
    return tuple(synthetic.read_split(source, split))
  _prepared(source)
  data = tfds.data_source(f'toy_translation/{source.task}', data_dir=source.data_dir, split=split)
  records = data.__getitems__(range(len(data)))
  return tuple((r['source'].decode(), r['target'].decode()) for r in records)


def _encode(tokenizer, src, tgt):
  """(source ids, target ids); a document (empty source) is all target: `_sequence` then gives
  `<bos> doc <eos>`, every token but <bos> to predict."""
  return (tokenizer.encode_source(src) if src else []), tokenizer.encode_target(tgt)


@functools.lru_cache(maxsize=None)
def _encoded_split(source, split: str) -> tuple[dict[str, np.ndarray], ...]:
  """The split as {'source', 'target'} int32 id arrays (no specials), cached per process; a
  synthetic task's as {'ids', 'scored'} (`data.synthetic.encode`)."""
  tokenizer = _tokenizer(source)
  if is_passkey(source) and source.tokenizer:  # generated as token ids (data.passkey_text)
    return passkey_text.encoded_split(source, split, passkey.SPLITS[split])
  if is_synthetic(source):
    return tuple(synthetic.encode(tokenizer, words, scored)
                 for words, scored in _read_split(source, split))
  # A Hugging Face tokenizer knows newlines and indentation: code reaches it as written.
  real_code = is_text(source) and source.code and bool(source.tokenizer)
  out = []
  for src, tgt in _read_split(source, split):
    src_ids, tgt_ids = _encode(tokenizer, src, python_code.decode_document(tgt) if real_code
                               else tgt)
    out.append({'source': np.asarray(src_ids, np.int32), 'target': np.asarray(tgt_ids, np.int32)})
  return tuple(out)


def load_examples(data_config, split: str) -> list[dict]:
  """Returns every pair of a split in file order, for translation evaluation.

  Args:
    data_config: ConfigDict with `task` and `data_dir`.
    split: a name from split_names.

  Returns:
    Dicts with 'source', 'target' (str) and 'source_ids', 'target_ids' (list[int], no bos/eos/sep).

  Raises:
    ValueError: a task of documents, prompts or synthetic rows (nothing to translate).
  """
  _check_split(data_config, split)
  if not has_pairs(data_config):
    task = _field(data_config, 'task', 'base')
    holds = 'documents' if task in DOCUMENT_TASKS else 'prompts'
    raise ValueError(f'data.task={task!r} holds {holds}, '
                     'not sentence pairs: nothing to translate; valid: loss/perplexity splits')
  source = _source(data_config)
  tokenizer = _tokenizer(source)
  out = []
  for src, tgt in _read_split(source, split):
    src_ids, tgt_ids = _encode(tokenizer, src, tgt)
    out.append({'source': src, 'target': tgt, 'source_ids': src_ids, 'target_ids': tgt_ids})
  return out


from data.rows import (  # noqa: E402, F401  (re-exported)
    BATCH_FORMATS, PACKINGS, STREAM_SHIFTS, TOY_IDS, LayoutIds, _check, _fits, _row_length,
    _sequence, batch_shapes, layout_ids)



class DataIterator:
  """Batches as dicts of numpy arrays, with a JSON-serialisable position (get_state/set_state)."""

  def __init__(self, dataset, num_dropped: int):
    self._iterator = iter(dataset)
    self.num_dropped = num_dropped  # Pairs per epoch of this shard too long for a row.

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def get_state(self) -> dict:
    """Returns the grain iterator state, with tuples and numpy scalars made JSON types."""
    return _to_json(self._iterator.get_state())

  def set_state(self, state: dict) -> None:
    """Restores a state from get_state: the next batches are those that followed it."""
    # JSON turned tuples into lists; grain's concat-then-split compares its slices with a tuple
    # sentinel, and none of the states here holds a real list.
    self._iterator.set_state(_to_tuples(state))


def _to_tuples(value):
  if isinstance(value, dict):
    return {k: _to_tuples(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return tuple(_to_tuples(v) for v in value)
  return value


def _to_json(value):
  if isinstance(value, dict):
    return {k: _to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_json(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


def make_iterator(data_config, split: str, batch_size: int, *, batch_format: str = 'next_token',
                  loss_on: str = 'target', seed: int = 0, shuffle: bool = True,
                  repeat: bool = True, drop_remainder: bool = True, shard_index: int = 0,
                  shard_count: int = 1, length: int | None = None) -> DataIterator:
  """Returns a deterministic, resumable iterator of batches.

  Args:
    data_config: ConfigDict with `task`, `data_dir`, `max_length` and `packing`.
    split: a name from split_names.
    batch_size: rows per batch (per process).
    batch_format: the row layout, a key of BATCH_FORMATS (a model's `models.batch_format`).
    loss_on: 'target' (next_token rows weight only the target side) or 'all'.
    seed: shuffling seed; the same seed gives the same batches.
    shuffle: shuffle pairs (reshuffled each epoch) and packed rows.
    repeat: loop over the split forever.
    drop_remainder: drop a last, smaller batch.
    shard_index: this process's shard, in [0, shard_count).
    shard_count: number of disjoint shards of the split (one per process).
    length: row length L, overriding data_config.max_length (e.g. for long evaluation).

  Returns:
    A DataIterator of dicts of [B, L] arrays (int32, weights float32).
  """
  packing = _field(data_config, 'packing', 'none')
  _check('packing', packing, list(PACKINGS))
  _check('batch_format', batch_format, list(BATCH_FORMATS))
  _check('loss_on', loss_on, LOSS_ON)
  if not 0 <= shard_index < shard_count:
    raise ValueError(f'shard_index {shard_index} must be in [0, shard_count={shard_count})')
  length = length or _field(data_config, 'max_length', 64)
  _check_split(data_config, split)
  source = _source(data_config)

  if packing == 'stream' and batch_format not in STREAM_SHIFTS:
    raise ValueError(f"Unsupported packing 'stream' for batch format {batch_format!r}; "
                     "valid values: none, segments")
  shard = _encoded_split(source, split)[shard_index::shard_count]
  ids = layout_ids(_tokenizer(source))  # the tokenizer's bos, eos, sep and pad
  # Passkey and synthetic rows are generated to fit: a stream's fit (all) for them.
  whole_rows = is_passkey(source) or is_synthetic(source)
  fits = functools.partial(_fits, length=length, batch_format=batch_format,
                           packing='stream' if whole_rows else packing, ids=ids)
  num_dropped = sum(not fits(pair) for pair in shard)
  if num_dropped:
    logging.warning('%s/%s: %d of %d pairs longer than %d tokens are dropped (packing %s).',
                    split, batch_format, num_dropped, len(shard), length, packing)
  pairs = grain.MapDataset.source(shard).filter(fits)
  if shuffle:
    pairs = pairs.shuffle(seed=seed)
  if repeat:
    pairs = pairs.repeat()  # Each epoch is shuffled anew (grain reseeds per epoch).
  # Per-element work is a few microseconds: grain's default thread prefetch costs more than it
  # saves (its depth bookkeeping dominated: ~60 ms per batch of 64, ~25 without it).
  pairs = pairs.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  if is_passkey(source):  # next_token rows, loss on the value only (validation checks both)
    rows = pairs.map(lambda pair: passkey.row(pair['source'], pair['target'], length,
                                              bos=ids.bos, pad=ids.pad))
  elif is_synthetic(source):  # next_token rows of data.max_length, loss on the scored tokens
    if length != source.length:
      raise ValueError(f'data.task={source.task!r} rows hold data.max_length={source.length} '
                       f'tokens; a length of {length} was asked for')
    rows = pairs.map(lambda ex: synthetic.row(ex['ids'], ex['scored'], length))
  else:
    rows = PACKINGS[packing](pairs, length, batch_format, loss_on, batch_size, seed, shuffle,
                             ids=ids)
  batches = rows.batch(batch_size, drop_remainder=drop_remainder)
  # A background thread builds the next batches while the (GIL-releasing) train step runs.
  batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=2)
  return DataIterator(batches, num_dropped)


class ShardedIterator:
  """Global batches of `num_shards` disjoint shards of a split, of which this process reads only
  `shards` (a range): each global batch is the concatenation, in shard order, of `batch_size /
  num_shards` rows from every shard's own iterator (`make_iterator(shard_index=s, ...)`), so the
  batches do not depend on how many processes read them. `next` returns the rows of `shards` only,
  rows `shards.start * batch_size / num_shards` onwards of the global batch.

  The state is {'shards': {s: state of shard s}} (one process's shards; `merge_states` joins the
  processes' states for a checkpoint, and `set_state` takes its own shards from such a merge). With
  one shard it is that shard's plain `DataIterator` state.
  """

  def __init__(self, data_config, split: str, batch_size: int, num_shards: int, shards: range,
               **kwargs):
    if batch_size % num_shards:
      raise ValueError(f'data.shards={num_shards} must divide train.batch_size={batch_size}')
    self.num_shards, self.shards = num_shards, shards
    self.rows_per_shard = batch_size // num_shards
    seed = kwargs.pop('seed', 0)
    # Each shard shuffles with its own seed (with one seed, equal-sized shards would share one
    # permutation, and every batch would hold runs of neighbouring pairs); one shard keeps `seed`.
    self._its = {s: make_iterator(data_config, split, self.rows_per_shard, shard_index=s,
                                  shard_count=num_shards,
                                  seed=seed if num_shards == 1 else seed * num_shards + s, **kwargs)
                 for s in shards}

  @property
  def first_row(self) -> int:
    """The global-batch row of this process's first row."""
    return self.shards.start * self.rows_per_shard

  @property
  def num_dropped(self) -> int:
    return sum(it.num_dropped for it in self._its.values())

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    parts = [next(self._its[s]) for s in self.shards]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> dict:
    if self.num_shards == 1:
      return self._its[0].get_state()
    return {'shards': {str(s): it.get_state() for s, it in self._its.items()}}

  def set_state(self, state: dict) -> None:
    if self.num_shards == 1:
      self._its[0].set_state(state)
      return
    for s, it in self._its.items():
      it.set_state(state['shards'][str(s)])

  @staticmethod
  def merge_states(states):
    """One state of every shard from the states of processes that each read some of them."""
    if 'shards' not in states[0]:
      return states[0]
    return {'shards': {s: v for state in states for s, v in state['shards'].items()}}


def stream_tokens(data_config, split: str) -> tuple[np.ndarray, np.ndarray]:
  """A split as one token stream in file order, as packing='stream' sees it (for evaluation).

  Returns:
    (tokens, in_target): `[M]` int32 `<bos> src <sep> tgt <eos> <bos> ...` and `[M]` float32, 1 on
    target-side tokens (target words and their eos).
  """
  _check_split(data_config, split)
  source = _source(data_config)
  ids = layout_ids(_tokenizer(source))
  parts = [_sequence(p['source'], p['target'], ids) for p in _encoded_split(source, split)]
  return (np.concatenate([t for t, _ in parts]).astype(np.int32),
          np.concatenate([m for _, m in parts]).astype(np.float32))
