"""Row layouts of the input pipeline: one pair as a padded row of a batch format
(`BATCH_FORMATS`), pairs packed into segments, or a stream cut into rows (`PACKINGS`);
data.pipeline batches with them."""

import dataclasses
import functools

import grain
import numpy as np

from data import tokenizer as tokenizer_lib

BOS, EOS, SEP = tokenizer_lib.BOS, tokenizer_lib.EOS, tokenizer_lib.SEP


@dataclasses.dataclass(frozen=True)
class LayoutIds:
  """The special ids a row is laid out with, from the tokenizer (`layout_ids`).

  Attributes:
    bos: starts every sequence; None: the tokenizer has none, sequences start with their text.
    eos: ends every sequence.
    sep: between a source and its target (None: a tokenizer for documents only).
    pad: fills a padded row's token features.
  """
  bos: int | None
  eos: int
  sep: int | None
  pad: int


TOY_IDS = LayoutIds(bos=BOS, eos=EOS, sep=SEP, pad=tokenizer_lib.PAD)  # every data/ tokenizer's
#                                                                        but the Hugging Face one


def layout_ids(tokenizer) -> LayoutIds:
  """The LayoutIds of a tokenizer with `bos_id`, `eos_id`, `sep_id` and `pad_id`."""
  return LayoutIds(bos=tokenizer.bos_id, eos=tokenizer.eos_id, sep=tokenizer.sep_id,
                   pad=tokenizer.pad_id)


def _check(name, value, valid):
  if value not in valid:
    raise ValueError(f'Unknown {name} {value!r}; valid values: {", ".join(valid)}')


def _sequence(src, tgt, ids=TOY_IDS):
  """Returns `<bos> src <sep> tgt <eos>` and its target-side mask (1 on tgt and the eos); with an
  empty src (a text_lm document) `<bos> tgt <eos>`, no <sep>. A tokenizer without a bos
  (`ids.bos` None) starts the sequence with its text."""
  head = [] if ids.bos is None else [ids.bos]
  if len(src) == 0:
    tokens = np.concatenate([head, tgt, [ids.eos]]).astype(np.int32)
    return tokens, (np.arange(len(tokens)) >= len(head)).astype(np.float32)
  if ids.sep is None:
    raise ValueError('a source and a target need a <sep> id; the tokenizer has none')
  tokens = np.concatenate([head, src, [ids.sep], tgt, [ids.eos]]).astype(np.int32)
  in_target = (np.arange(len(tokens)) > len(head) + len(src)).astype(np.float32)
  return tokens, in_target


# Per-example features of each batch format, from source and target ids. Feature-name prefixes
# ('src_', 'tgt_', none) group the features that share segment ids and positions.
def _next_token(src, tgt, loss_on, ids=TOY_IDS):
  """One row whose targets are the next tokens (a causal LM)."""
  tokens, in_target = _sequence(src, tgt, ids)
  weights = in_target[1:] if loss_on == 'target' else np.ones(len(tokens) - 1, np.float32)
  return {'inputs': tokens[:-1], 'targets': tokens[1:], 'weights': weights}


def _same_token(src, tgt, loss_on, ids=TOY_IDS):
  """One row whose targets are its own tokens (a model that masks or corrupts its inputs)."""
  del loss_on  # The model's masking step chooses what to predict.
  tokens, _ = _sequence(src, tgt, ids)
  return {'inputs': tokens, 'targets': tokens, 'weights': np.ones(len(tokens), np.float32)}


def _source_target(src, tgt, loss_on, ids=TOY_IDS):
  """A source row and a target row (`src_*`, `tgt_*`): the target predicts its next tokens (from
  the eos where the tokenizer has no bos)."""
  del loss_on  # The decoder only predicts the target.
  start = ids.eos if ids.bos is None else ids.bos
  return {'src_inputs': np.append(src, ids.eos).astype(np.int32),
          'tgt_inputs': np.insert(tgt, 0, start).astype(np.int32),
          'tgt_targets': np.append(tgt, ids.eos).astype(np.int32),
          'tgt_weights': np.ones(len(tgt) + 1, np.float32)}


# `batch_format` -> the features of one pair. A model declares the one it reads
# (models.contract.ArchSpec.batch_format).
BATCH_FORMATS = {
    'next_token': _next_token,
    'same_token': _same_token,
    'source_target': _source_target,
}
# The formats a stream (packing='stream') can be cut into: one row of tokens, shifted by this much
# between inputs and targets. A source and a target row cannot be cut from one stream.
STREAM_SHIFTS = {'next_token': 1, 'same_token': 0}


def _group(feature: str) -> str:
  """The segment group of a feature: its 'src_'/'tgt_' prefix, or ''."""
  return feature[:4] if feature[:4] in ('src_', 'tgt_') else ''


# Packings turn an IterDataset of pairs ({'source', 'target'} id arrays) into rows of length L.
def _pad_rows(pairs, length, batch_format, loss_on, batch_size, seed, shuffle, ids=TOY_IDS):
  """packing='none': one pair per row, right-padded to length."""
  del batch_size, seed, shuffle
  return pairs.map(lambda pair: _pad_row(pair, length, batch_format, loss_on, ids))


def _pad_row(pair, length, batch_format, loss_on, ids=TOY_IDS):
  """One pair's features right-padded to `length` (token ids with the pad id, weights with 0),
  with each group's segment ids and positions."""
  row = {}
  features = BATCH_FORMATS[batch_format](pair['source'], pair['target'], loss_on, ids)
  for name, value in features.items():
    fill = ids.pad if value.dtype == np.int32 else 0
    row[name] = np.full(length, fill, value.dtype)
    row[name][:len(value)] = value
    group = _group(name)
    if f'{group}segment_ids' not in row:  # The group's first feature defines its extent.
      real = np.arange(length) < len(value)
      row[f'{group}segment_ids'] = real.astype(np.int32)
      row[f'{group}positions'] = np.where(real, np.arange(length), 0).astype(np.int32)
  return row


def batch_shapes(batch_format: str, batch_size: int, length: int) -> dict[str, tuple]:
  """{feature: (shape, dtype)} of the batches `make_iterator` yields in `batch_format` (every
  packing gives the same features), without reading data: for abstract (ahead-of-time)
  compilation."""
  _check('batch_format', batch_format, list(BATCH_FORMATS))
  one = np.ones(1, np.int32)
  row = _pad_row({'source': one, 'target': one}, max(length, 4), batch_format, 'target')
  return {name: ((batch_size, length), value.dtype) for name, value in row.items()}


def _pack_segments(pairs, length, batch_format, loss_on, batch_size, seed, shuffle, ids=TOY_IDS):
  """packing='segments': first-fit packing of whole pairs; attention must respect segment_ids."""
  features = BATCH_FORMATS[batch_format]
  names = list(features(np.zeros(1, np.int32), np.zeros(1, np.int32), loss_on, ids))
  packed = grain.experimental.FirstFitPackIterDataset(
      pairs.map(lambda pair: features(pair['source'], pair['target'], loss_on, ids)),
      length_struct={name: length for name in names},
      # As many open bins as rows in a batch: fuller rows than one bin, little buffering.
      num_packing_bins=max(batch_size, 2), seed=seed, shuffle_bins=shuffle)

  def rename(row):
    out = {name: row[name] for name in names}
    for name in names:
      group = _group(name)
      if f'{group}segment_ids' not in out:
        out[f'{group}segment_ids'] = row[f'{name}_segment_ids'].astype(np.int32)
        out[f'{group}positions'] = row[f'{name}_positions'].astype(np.int32)
    return out

  return packed.map(rename)


def _stream(pairs, length, batch_format, loss_on, batch_size, seed, shuffle, ids=TOY_IDS):
  """packing='stream': pairs concatenated and cut into rows, no padding, attention across pairs."""
  del batch_size, seed, shuffle
  # Shifted rows hold L+1 stream tokens so that inputs and targets (shifted) both have L.
  shift = STREAM_SHIFTS[batch_format]

  def to_stream(pair):
    tokens, in_target = _sequence(pair['source'], pair['target'], ids)
    return {'tokens': tokens, 'in_target': in_target}

  chunks = grain.experimental.ConcatThenSplitIterDataset(
      pairs.map(to_stream), length_struct={'tokens': length + shift, 'in_target': length + shift})

  def to_row(chunk):
    tokens, real = chunk['tokens'], chunk['tokens_segment_ids'] > 0  # Only a last row has pads.
    if shift and loss_on == 'target':  # the next-token rows weight the target side
      weights = chunk['in_target'][shift:] * real[shift:]
    else:
      weights = real[shift:]
    return {'inputs': tokens[:length], 'targets': tokens[shift:],
            'weights': weights.astype(np.float32),
            'segment_ids': real[:length].astype(np.int32),
            'positions': np.where(real[:length], np.arange(length), 0).astype(np.int32)}

  return chunks.map(to_row)


PACKINGS = {'none': _pad_rows, 'segments': _pack_segments, 'stream': _stream}


@functools.lru_cache(maxsize=None)
def _row_length(batch_format: str, source_len: int, target_len: int, ids=TOY_IDS) -> int:
  """Longest feature of a pair with these lengths (cached: a few hundred distinct pairs)."""
  dummy = BATCH_FORMATS[batch_format](np.zeros(source_len, np.int32),
                                      np.zeros(target_len, np.int32), 'all', ids)
  return max(len(v) for v in dummy.values())


def _fits(pair, *, length, batch_format, packing, ids=TOY_IDS):
  """Whether every feature of a pair fits in a row (streams split pairs, so all fit)."""
  return packing == 'stream' or _row_length(batch_format, len(pair['source']),
                                            len(pair['target']), ids) <= length
