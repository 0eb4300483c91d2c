"""Tests of data/: the toy translation corpus, the tokenizer and the grain pipeline."""

import json
import os
import time

import ml_collections
import numpy as np
import pytest

from data import pipeline
from data import tokenizer as tokenizer_lib
from data import toy_translation

L = 64


_FIELDS = {
    'next_token': ['inputs', 'targets', 'weights', 'segment_ids', 'positions'],
    'same_token': ['inputs', 'targets', 'weights', 'segment_ids', 'positions'],
    'source_target': ['src_inputs', 'src_segment_ids', 'src_positions', 'tgt_inputs',
                        'tgt_targets', 'tgt_weights', 'tgt_segment_ids', 'tgt_positions'],
}

_CASES = [(p, a) for p in pipeline.PACKINGS for a in pipeline.BATCH_FORMATS
          if (p, a) != ('stream', 'source_target')]


def _config(data_dir, packing='none'):
  """The data config over the session's shared toy dataset (tests/conftest.py `data_dir`)."""
  return ml_collections.ConfigDict(
      dict(task='base', data_dir=str(data_dir), max_length=L, packing=packing))


@pytest.fixture(scope='session')
def corpus():
  return toy_translation.generate_corpus(toy_translation.TASKS['base'])


@pytest.fixture(scope='session')
def tok(data_dir):
  return pipeline.get_tokenizer(_config(data_dir))


def _seq_len(pair):
  """Tokens of `<bos> src <sep> tgt <eos>`."""
  return len(pair[0].split()) + len(pair[1].split()) + 3


def test_generation_is_deterministic_and_matches_the_files(data_dir, corpus):
  again = toy_translation.generate_corpus(toy_translation.TASKS['base'])
  assert again == corpus
  for split, pairs in corpus.items():
    stored = pipeline.load_examples(_config(data_dir), split)
    # TFDS stores the pairs in key-hash order: compare as sets of pairs.
    assert {(e['source'], e['target']) for e in stored} == set(pairs)


def test_split_sizes_and_disjoint_sources(corpus):
  sizes = {split: len(pairs) for split, pairs in corpus.items()}
  assert sizes == {'test': 1000, 'validation': 1000, 'test_long': 1000, 'test_xlong': 1000,
                   'train': 20000}
  sources = [src for pairs in corpus.values() for src, _ in pairs]
  assert len(set(sources)) == len(sources)  # Unique within and across splits.


def test_golden_pairs_show_reordering(corpus):
  # SVO -> SOV, adjectives after the noun (mirrored), determiner last, postposition, object case.
  assert corpus['train'][2] == (
      'the quiet sad duck chased the snake near some boys',
      'ahiru kanashii shizuka le shonen ra su chikaku hebi le o otta')
  # Relative clause: follows its noun, with its own object before its verb.
  assert corpus['train'][5] == (
      'the ant that found the quiet dog found a boat',
      'ari le ki inu shizuka le o mitsuketa fune un o mitsuketa')


def test_every_target_ends_with_the_main_verb_and_languages_are_disjoint(corpus):
  verbs = {**toy_translation.TRANSITIVE_VERBS, **toy_translation.INTRANSITIVE_VERBS}
  src_words, tgt_words = set(), set()
  for src, tgt in corpus['train']:
    src_words.update(src.split())
    tgt_words.update(tgt.split())
    # SOV: the main verb closes the sentence (relative clauses end before it).
    assert tgt.split()[-1] in verbs.values()
  assert not src_words & tgt_words
  assert src_words | tgt_words <= set(toy_translation.vocabulary())


def test_lengths_per_split(corpus):
  words = {s: [len(p[0].split()) for p in pairs] for s, pairs in corpus.items()}
  for split in ('train', 'validation', 'test'):
    assert (min(words[split]), max(words[split])) == (3, 12)
    assert max(map(_seq_len, corpus[split])) <= L
  assert (min(words['test_long']), max(words['test_long'])) == (13, 25)
  assert (min(words['test_xlong']), max(words['test_xlong'])) == (26, 40)
  assert min(map(_seq_len, corpus['test_long'])) > np.median(
      [_seq_len(p) for p in corpus['train']])
  assert max(map(_seq_len, corpus['test_xlong'])) > L


def test_prepare_is_idempotent_and_fast(data_dir):
  path = toy_translation.prepare(data_dir, 'base')
  mtimes = {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)}
  start = time.time()
  assert toy_translation.prepare(data_dir, 'base') == path
  assert time.time() - start < 1.0
  assert {f: os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)} == mtimes
  assert toy_translation.TOKENIZER_FILE in mtimes


def test_tokenizer_special_ids_round_trip_and_save(tok, tmp_path):
  assert tok.tokens[:6] == ['<pad>', '<bos>', '<eos>', '<sep>', '<mask>', '<unk>']
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, tok.mask_id, tok.unk_id) == tuple(
      range(6))
  assert tok.vocab_size == 6 + len(toy_translation.vocabulary())
  assert tok.tokens[6:] == sorted(tok.tokens[6:])
  text = 'the big cat saw some dogs'
  ids = tok.encode(text)
  assert min(ids) >= 6 and tok.decode(ids) == text
  assert tok.encode('zebra') == [tokenizer_lib.UNK]
  framed = [1] + ids + [2, 0, 0, 7]
  assert tok.decode(framed) == f'<bos> {text} <eos> {tok.tokens[7]}'
  assert tok.decode(framed, stop_at_eos=True, skip_special=True) == text
  tok.save(str(tmp_path / 'tok.json'))
  assert tokenizer_lib.Tokenizer.load(str(tmp_path / 'tok.json')).tokens == tok.tokens


@pytest.mark.parametrize('packing,arch', _CASES)
def test_batch_shapes_and_dtypes(data_dir, packing, arch):
  batch = next(pipeline.make_iterator(_config(data_dir, packing), 'train', 8, batch_format=arch))
  assert sorted(batch) == sorted(_FIELDS[arch])
  for name, value in batch.items():
    assert value.shape == (8, L), name
    assert value.dtype == (np.float32 if 'weights' in name else np.int32), name


def test_stream_encoder_decoder_and_unknown_values_raise(data_dir):
  with pytest.raises(ValueError, match="packing 'stream'"):
    pipeline.make_iterator(_config(data_dir, 'stream'), 'train', 2,
                           batch_format='source_target')
  with pytest.raises(ValueError, match='Unknown packing .*none, segments, stream'):
    pipeline.make_iterator(_config(data_dir, 'bins'), 'train', 2)
  for kwargs, field in [({'batch_format': 'gpt'}, 'batch_format'),
                        ({'loss_on': 'source'}, 'loss_on')]:
    with pytest.raises(ValueError, match=f'Unknown {field}'):
      pipeline.make_iterator(_config(data_dir), 'train', 2, **kwargs)
  with pytest.raises(ValueError, match='Unknown split .*test_long'):
    pipeline.load_examples(_config(data_dir), 'dev')


def test_decoder_only_weights_hand_checked():
  src, tgt = np.array([10, 11]), np.array([20, 21, 22])
  # <bos> 10 11 <sep> 20 21 22 <eos>
  target_side = pipeline.BATCH_FORMATS['next_token'](src, tgt, 'target')
  np.testing.assert_array_equal(target_side['inputs'], [1, 10, 11, 3, 20, 21, 22])
  np.testing.assert_array_equal(target_side['targets'], [10, 11, 3, 20, 21, 22, 2])
  np.testing.assert_array_equal(target_side['weights'], [0, 0, 0, 1, 1, 1, 1])
  everything = pipeline.BATCH_FORMATS['next_token'](src, tgt, 'all')
  np.testing.assert_array_equal(everything['weights'], [1, 1, 1, 1, 1, 1, 1])
  enc_dec = pipeline.BATCH_FORMATS['source_target'](src, tgt, 'target')
  np.testing.assert_array_equal(enc_dec['src_inputs'], [10, 11, 2])
  np.testing.assert_array_equal(enc_dec['tgt_inputs'], [1, 20, 21, 22])
  np.testing.assert_array_equal(enc_dec['tgt_targets'], [20, 21, 22, 2])


def _target_language_ids(tok):
  target_words = {w for table in (toy_translation.NOUNS, toy_translation.ADJECTIVES,
                                  toy_translation.TRANSITIVE_VERBS,
                                  toy_translation.INTRANSITIVE_VERBS, toy_translation.PREPOSITIONS,
                                  toy_translation.SINGULAR_DETERMINERS,
                                  toy_translation.PLURAL_DETERMINERS) for w in table.values()}
  target_words |= {toy_translation.RELATIVIZER[1], toy_translation.PLURAL_MARKER,
                   toy_translation.OBJECT_CASE}
  return np.array([tok.encode(w)[0] for w in target_words] + [tokenizer_lib.EOS])


@pytest.mark.parametrize('packing', list(pipeline.PACKINGS))
def test_decoder_only_weights_in_batches(data_dir, tok, packing):
  config = _config(data_dir, packing)
  target_ids = _target_language_ids(tok)
  batch = next(pipeline.make_iterator(config, 'train', 16, loss_on='target'))
  real = batch['targets'] != 0
  expected = np.isin(batch['targets'], target_ids) & real
  np.testing.assert_array_equal(batch['weights'], expected.astype(np.float32))
  batch_all = next(pipeline.make_iterator(config, 'train', 16, loss_on='all'))
  np.testing.assert_array_equal(batch_all['weights'], (batch_all['targets'] != 0).astype(
      np.float32))
  if packing == 'none':
    np.testing.assert_array_equal(batch['segment_ids'], (batch['inputs'] != 0).astype(np.int32))
    np.testing.assert_array_equal(batch['positions'], np.where(
        batch['inputs'] != 0, np.arange(L), 0))


def test_segments_keep_pairs_intact_and_restart_positions(data_dir, tok, corpus):
  pairs = set(corpus['train'])
  batch = next(pipeline.make_iterator(_config(data_dir, 'segments'), 'train', 8))
  num_segments = 0
  for row in range(8):
    seg = batch['segment_ids'][row]
    for s in range(1, seg.max() + 1):
      idx = np.flatnonzero(seg == s)
      assert np.array_equal(idx, np.arange(idx[0], idx[-1] + 1))  # contiguous
      np.testing.assert_array_equal(batch['positions'][row, idx], np.arange(len(idx)))
      tokens = list(batch['inputs'][row, idx]) + [batch['targets'][row, idx[-1]]]
      text = tok.decode(tokens)
      assert text.startswith('<bos> ') and text.endswith(' <eos>')
      src, tgt = text[len('<bos> '):-len(' <eos>')].split(' <sep> ')
      assert (src, tgt) in pairs
      num_segments += 1
  assert num_segments > 8  # Rows really hold several pairs.


def test_stream_rows_are_contiguous_slices_of_the_stream(data_dir, tok):
  config = _config(data_dir, 'stream')
  iterator = pipeline.make_iterator(config, 'test', 4, shuffle=False, repeat=False)
  batches = [next(iterator) for _ in range(3)]
  stream = []
  for e in pipeline.load_examples(config, 'test'):  # File order, as with shuffle=False.
    stream += [1] + e['source_ids'] + [3] + e['target_ids'] + [2]
  offset = 0
  for batch in batches:
    np.testing.assert_array_equal(batch['targets'][:, :-1], batch['inputs'][:, 1:])
    assert (batch['segment_ids'] == 1).all()
    for row in range(4):
      chunk = list(batch['inputs'][row]) + [batch['targets'][row, -1]]  # L + 1 tokens
      assert chunk == stream[offset:offset + L + 1]
      offset += L + 1


@pytest.mark.parametrize('packing,arch', [('none', 'next_token'), ('segments', 'next_token'),
                                          ('stream', 'next_token'), ('stream', 'same_token'),
                                          ('segments', 'source_target')])
def test_resume_from_state_gives_the_same_batches(data_dir, packing, arch):
  config = _config(data_dir, packing)
  iterator = pipeline.make_iterator(config, 'train', 4, batch_format=arch, seed=3)
  for _ in range(3):
    next(iterator)
  state = json.loads(json.dumps(iterator.get_state()))  # As a checkpoint would store it.
  expected = [next(iterator) for _ in range(3)]
  resumed = pipeline.make_iterator(config, 'train', 4, batch_format=arch, seed=3)
  resumed.set_state(state)
  for want, got in zip(expected, [next(resumed) for _ in range(3)]):
    for name in want:
      np.testing.assert_array_equal(want[name], got[name])


def test_same_seed_same_batches_other_seed_other_batches(data_dir):
  config = _config(data_dir)
  first = next(pipeline.make_iterator(config, 'train', 8, seed=1))
  np.testing.assert_array_equal(first['inputs'],
                                next(pipeline.make_iterator(config, 'train', 8, seed=1))['inputs'])
  assert not np.array_equal(first['inputs'],
                            next(pipeline.make_iterator(config, 'train', 8, seed=2))['inputs'])


def test_shards_are_disjoint_and_cover_the_split(data_dir):
  config = _config(data_dir)
  seen = []
  for index in range(2):
    iterator = pipeline.make_iterator(config, 'validation', 50, shard_index=index, shard_count=2,
                                      repeat=False, drop_remainder=False)
    seen.append({tuple(row) for batch in iterator for row in batch['inputs']})
  assert not seen[0] & seen[1]
  assert len(seen[0]) + len(seen[1]) == 1000


def test_sharded_batches_do_not_depend_on_who_reads_the_shards(data_dir):
  """data.shards=4: one reader of all four shards sees the rows that two readers of two shards see,
  in shard order; the readers' states merge into one that resumes either way."""
  config = _config(data_dir)
  whole = pipeline.ShardedIterator(config, 'train', 8, 4, range(4), seed=3)
  halves = [pipeline.ShardedIterator(config, 'train', 8, 4, range(2 * i, 2 * i + 2), seed=3)
            for i in range(2)]
  assert [h.first_row for h in halves] == [0, 4]
  for _ in range(2):
    batch = next(whole)
    parts = [next(h) for h in halves]
    for name in batch:
      np.testing.assert_array_equal(batch[name], np.concatenate([p[name] for p in parts]))
  merged = pipeline.ShardedIterator.merge_states(
      [json.loads(json.dumps(h.get_state())) for h in halves])
  assert merged == json.loads(json.dumps(whole.get_state()))
  expected = next(whole)
  resumed = pipeline.ShardedIterator(config, 'train', 8, 4, range(2, 4), seed=3)
  resumed.set_state(merged)
  np.testing.assert_array_equal(next(resumed)['inputs'], expected['inputs'][4:])


def test_too_long_pairs_are_dropped_and_counted(data_dir):
  config = _config(data_dir)
  long_pairs = pipeline.load_examples(config, 'test_xlong')
  too_long = sum(len(e['source_ids']) + len(e['target_ids']) + 2 > L for e in long_pairs)
  iterator = pipeline.make_iterator(config, 'test_xlong', 10, repeat=False, drop_remainder=False)
  assert iterator.num_dropped == too_long > 0
  assert sum(len(b['inputs']) for b in iterator) == 1000 - too_long
  longer = pipeline.make_iterator(config, 'test_xlong', 10, length=128, repeat=False)
  assert longer.num_dropped == 0 and next(longer)['inputs'].shape == (10, 128)
