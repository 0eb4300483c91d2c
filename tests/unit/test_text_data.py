"""Tests of your own data (data/text_corpus.py, data/sentencepiece_tokenizer.py): a seeded corpus of
real words, its SentencePiece round trip, the prepared folder's reuse, the pipeline over it, and
every bad input as one DataError line naming the file and line, with data_dir left as it was."""

import json
import os
import random

import ml_collections
import numpy as np
import pytest

from data import pipeline
from data import sentencepiece_tokenizer as spt
from data import text_corpus
from data import tokenizer as tokenizer_lib
from layers import options
from training import translation
from training import validation
from tests.helpers import ROOT

VOCAB = 80  # the corpus below allows up to ~188 pieces shared, ~92 for one side

# English -> German, word by word, the verb moved to the end (SOV): learnable by a tiny model.
NOUNS = {'cat': 'katze', 'dog': 'hund', 'bird': 'vogel', 'house': 'haus', 'tree': 'baum',
         'river': 'fluss', 'garden': 'garten', 'child': 'kind', 'teacher': 'lehrer',
         'farmer': 'bauer', 'doctor': 'arzt', 'friend': 'freund', 'king': 'koenig',
         'horse': 'pferd', 'mouse': 'maus', 'book': 'buch', 'table': 'tisch', 'door': 'tuer',
         'car': 'auto', 'boat': 'boot', 'city': 'stadt', 'village': 'dorf', 'forest': 'wald',
         'flower': 'blume', 'apple': 'apfel', 'letter': 'brief', 'song': 'lied', 'picture': 'bild'}
VERBS = {'sees': 'sieht', 'likes': 'mag', 'finds': 'findet', 'follows': 'folgt', 'helps': 'hilft',
         'watches': 'beobachtet', 'visits': 'besucht', 'calls': 'ruft', 'knows': 'kennt',
         'paints': 'malt', 'reads': 'liest', 'writes': 'schreibt', 'buys': 'kauft',
         'carries': 'traegt'}
ADJECTIVES = {'big': 'grosse', 'small': 'kleine', 'red': 'rote', 'blue': 'blaue', 'old': 'alte',
              'young': 'junge', 'happy': 'gluckliche', 'sad': 'traurige', 'quiet': 'stille',
              'green': 'gruene', 'dark': 'dunkle'}
ADVERBS = {'today': 'heute', 'often': 'oft', 'always': 'immer', 'again': 'wieder'}


def _phrase(rng):
  adjs = rng.sample(sorted(ADJECTIVES), rng.choice((0, 0, 1, 2)))
  noun = rng.choice(sorted(NOUNS))
  return ['the'] + adjs + [noun], ['die'] + [ADJECTIVES[a] for a in adjs] + [NOUNS[noun]]


def sample_pair(rng):
  """One (English, German) pair: subject verb object [adverb] -> subject [adverb] object verb."""
  subj_src, subj_tgt = _phrase(rng)
  obj_src, obj_tgt = _phrase(rng)
  verb = rng.choice(sorted(VERBS))
  adv = [rng.choice(sorted(ADVERBS))] if rng.random() < 0.3 else []
  src = subj_src + [verb] + obj_src + adv
  tgt = subj_tgt + [ADVERBS[a] for a in adv] + obj_tgt + [VERBS[verb]]
  return ' '.join(src).capitalize() + '.', ' '.join(tgt).capitalize() + '.'


def write_corpus(directory, *, num_train=2000, num_eval=200, seed=0, lm=False):
  """Writes train/validation/test files of distinct pairs (TSV) or documents (lm: 3-6 English
  sentences a line) into directory; returns {split: path}."""
  rng = random.Random(seed)
  os.makedirs(directory, exist_ok=True)
  seen, paths = set(), {}
  for split, n in (('train', num_train), ('validation', num_eval), ('test', num_eval)):
    lines = []
    while len(lines) < n:
      if lm:
        line = ' '.join(sample_pair(rng)[0] for _ in range(rng.randint(3, 6)))
      else:
        line = '\t'.join(sample_pair(rng))
      if line not in seen:
        seen.add(line)
        lines.append(line)
    paths[split] = os.path.join(directory, f'{split}.{"txt" if lm else "tsv"}')
    with open(paths[split], 'w', encoding='utf-8') as f:
      f.write('\n'.join(lines) + '\n')
  return paths


def data_config(files, data_dir, task='text_pairs', **fields):
  """The data section of a text task over files ({split: path})."""
  config = dict(task=task, data_dir=str(data_dir), files=dict(files), vocab_size=VOCAB,
                shared_vocab=True, max_length=32, packing='none')
  return ml_collections.ConfigDict(dict(config, **fields))


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return write_corpus(str(tmp_path_factory.mktemp('corpus')))


@pytest.fixture(scope='module')
def lm_corpus(tmp_path_factory):
  return write_corpus(str(tmp_path_factory.mktemp('lm_corpus')), num_train=300, num_eval=40,
                      lm=True)


@pytest.fixture(scope='module')
def prepared(corpus, tmp_path_factory):
  """(data config, prepared folder) of the shared-vocabulary corpus."""
  config = data_config(corpus, tmp_path_factory.mktemp('text_data'))
  return config, text_corpus.prepare(text_corpus.spec_from_config(config))


def test_corpus_generator_is_seeded_and_real_words():
  rng1, rng2 = random.Random(3), random.Random(3)
  assert [sample_pair(rng1) for _ in range(5)] == [sample_pair(rng2) for _ in range(5)]
  src, tgt = sample_pair(random.Random(0))
  assert src.split()[0] == 'The' and src.endswith('.') and tgt.split()[0] == 'Die'


def test_tokenizer_round_trip_and_special_ids(prepared, corpus):
  config, folder = prepared
  tok = pipeline.get_tokenizer(config)
  assert isinstance(tok, spt.SentencePieceTokenizer) and tok.vocab_size == VOCAB
  assert os.path.exists(os.path.join(folder, spt.SHARED_FILE))  # kept beside the dataset
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.sep_id, tok.mask_id, tok.unk_id) == (
      tokenizer_lib.PAD, tokenizer_lib.BOS, tokenizer_lib.EOS, tokenizer_lib.SEP,
      tokenizer_lib.MASK, tokenizer_lib.UNK)
  assert tuple(tok.tokens[:6]) == tokenizer_lib.SPECIAL_TOKENS
  with open(corpus['test'], encoding='utf-8') as f:
    pairs = [line.rstrip('\n').split('\t') for line in f]
  for src, tgt in pairs:
    src_ids, tgt_ids = tok.encode_source(src), tok.encode_target(tgt)
    assert min(src_ids + tgt_ids) >= 6 and max(src_ids + tgt_ids) < tok.vocab_size
    assert tok.decode(src_ids) == src and tok.decode(tgt_ids) == tgt
  # Specials: pad always dropped, eos stops when asked, skip_special drops the rest.
  ids = tok.encode_target(pairs[0][1])
  assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id], skip_special=True) == pairs[0][1]
  assert tok.decode(ids + [tok.eos_id] + ids, stop_at_eos=True) == pairs[0][1]
  assert tok.decode([tok.sep_id] + ids) == '<sep> ' + pairs[0][1]


def test_separate_vocabularies_share_no_id(corpus, tmp_path):
  config = data_config(corpus, tmp_path, shared_vocab=False)
  tok = pipeline.get_tokenizer(config)
  assert {spt.SOURCE_FILE, spt.TARGET_FILE} <= set(os.listdir(
      text_corpus.prepare(text_corpus.spec_from_config(config))))
  assert tok.vocab_size == 2 * VOCAB - 6
  src, tgt = 'The small cat sees the dog.', 'Die kleine katze die hund sieht.'
  src_ids, tgt_ids = tok.encode_source(src), tok.encode_target(tgt)
  assert max(src_ids) < VOCAB <= min(tgt_ids) and max(tgt_ids) < tok.vocab_size
  assert tok.decode(src_ids) == src and tok.decode(tgt_ids) == tgt
  assert tok.decode(src_ids + [tok.sep_id] + tgt_ids) == f'{src} <sep> {tgt}'


def test_prepared_dataset_is_reused(prepared, monkeypatch):
  config, folder = prepared
  mtimes = {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in os.listdir(folder)}

  def no_build(*args):
    raise AssertionError('prepared again')
  monkeypatch.setattr(text_corpus, '_build', no_build)
  assert text_corpus.prepare(text_corpus.spec_from_config(config)) == folder
  assert {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)} == mtimes
  # Nothing else in data_dir: no temporary folder, no lock file.
  assert os.listdir(config.data_dir) == ['text_pairs']
  assert os.listdir(os.path.dirname(folder)) == [os.path.basename(folder)]


def test_other_vocab_size_or_changed_file_gets_its_own_folder(corpus, tmp_path):
  config = data_config(corpus, tmp_path / 'data')
  first = text_corpus.prepare(text_corpus.spec_from_config(config))
  config.vocab_size = VOCAB - 16
  second = text_corpus.prepare(text_corpus.spec_from_config(config))
  assert first != second and os.path.basename(second).startswith(f'vocab{VOCAB - 16}-shared-')
  assert text_corpus.load_tokenizer(first).vocab_size == VOCAB  # the first one is untouched
  assert text_corpus.load_tokenizer(second).vocab_size == VOCAB - 16
  changed = dict(corpus, test=str(tmp_path / 'test.tsv'))
  with open(changed['test'], 'w') as f:
    f.write('A cat.\tEine katze.\n')
  third = text_corpus.prepare(text_corpus.spec_from_config(data_config(changed, tmp_path / 'data')))
  assert third not in (first, second) and text_corpus.read_split(third, 'test') == [
      ('A cat.', 'Eine katze.')]


def test_interrupted_preparation_leaves_nothing_behind(corpus, tmp_path, monkeypatch):
  spec = text_corpus.spec_from_config(data_config(corpus, tmp_path / 'data'))
  build = text_corpus._build

  def killed_before_the_rename(*args):
    build(*args)  # every file written into the temporary folder
    raise KeyboardInterrupt
  monkeypatch.setattr(text_corpus, '_build', killed_before_the_rename)
  with pytest.raises(KeyboardInterrupt):
    text_corpus.prepare(spec)
  assert not (tmp_path / 'data').exists()
  # A SIGKILLed preparation cannot clean up: the next one removes its temporary folder.
  monkeypatch.setattr(text_corpus, '_build', build)
  _, digest = text_corpus.read_corpus(spec)
  stale = tmp_path / 'data' / 'text_pairs' / f'.{text_corpus.folder_name(spec, digest)}.tmpdead'
  stale.mkdir(parents=True)
  (stale / 'half.array_record').write_text('x')
  folder = text_corpus.prepare(spec)
  assert os.listdir(tmp_path / 'data' / 'text_pairs') == [os.path.basename(folder)]


def test_splits_read_back_in_file_order(prepared, corpus):
  config, _ = prepared
  assert pipeline.split_names(config) == ['train', 'validation', 'test']
  with open(corpus['validation'], encoding='utf-8') as f:
    expected = [tuple(line.rstrip('\n').split('\t')) for line in f]
  examples = pipeline.load_examples(config, 'validation')
  assert [(e['source'], e['target']) for e in examples] == expected
  tok = pipeline.get_tokenizer(config)
  assert examples[0]['target_ids'] == tok.encode_target(expected[0][1])


@pytest.mark.parametrize('packing', ['none', 'segments'])
def test_encoder_decoder_batches(prepared, packing):
  config, _ = prepared
  config = ml_collections.ConfigDict(config.to_dict())
  config.packing = packing
  batch = next(pipeline.make_iterator(config, 'train', 8, batch_format='source_target'))
  assert batch['src_inputs'].shape == (8, 32) and batch['tgt_targets'].shape == (8, 32)
  tok = pipeline.get_tokenizer(config)
  # Every row's first target segment decodes to a German sentence ending in its verb.
  row = batch['tgt_targets'][0][batch['tgt_segment_ids'][0] == 1]
  text = tok.decode(row, stop_at_eos=True)
  assert text.startswith('Die ') and text.split()[-1].rstrip('.') in set(VERBS.values())


def test_shards_give_the_same_global_batches_for_any_process_count(prepared):
  config, _ = prepared
  one = pipeline.ShardedIterator(config, 'train', 8, 2, range(0, 2), batch_format='source_target')
  halves = [pipeline.ShardedIterator(config, 'train', 8, 2, range(s, s + 1),
                                     batch_format='source_target') for s in (0, 1)]
  for _ in range(3):
    whole, parts = next(one), [next(h) for h in halves]
    for key in whole:
      np.testing.assert_array_equal(whole[key], np.concatenate([p[key] for p in parts]))


def test_text_lm_documents_stream(lm_corpus, tmp_path):
  config = data_config(lm_corpus, tmp_path, task='text_lm', packing='stream', max_length=64)
  tok = pipeline.get_tokenizer(config)
  tokens, in_target = pipeline.stream_tokens(config, 'test')
  with open(lm_corpus['test'], encoding='utf-8') as f:
    docs = [line.rstrip('\n') for line in f]
  first = tok.encode_target(docs[0])
  # `<bos> doc <eos>` per document (no <sep>: a document has no source side), all but <bos> scored.
  np.testing.assert_array_equal(tokens[:len(first) + 2], [tok.bos_id] + first + [tok.eos_id])
  assert tok.sep_id not in tokens and in_target[0] == 0 and in_target[1:len(first) + 2].all()
  assert (tokens == tok.bos_id).sum() == len(docs)
  batch = next(pipeline.make_iterator(config, 'train', 4, batch_format='next_token', loss_on='all'))
  assert batch['inputs'].shape == (4, 64) and batch['weights'].all()
  with pytest.raises(ValueError, match='nothing to translate'):
    pipeline.load_examples(config, 'test')


def test_bleu_and_exact_match_on_detokenized_text(prepared, monkeypatch):
  config, _ = prepared
  tok = pipeline.get_tokenizer(config)
  examples = pipeline.load_examples(config, 'test')[:3]
  # The first hypothesis spells its reference one character a piece: other ids, the same text.
  index = {piece: i for i, piece in enumerate(tok.tokens) if i >= 6}
  ids = examples[0]['target_ids']
  respelt = [index[c] for i in ids for c in tok.tokens[i]]
  assert respelt != ids and tok.decode(respelt) == examples[0]['target']
  wrong = tok.encode_target('Die katze sieht.')
  hyps = [respelt, examples[1]['target_ids'], wrong]
  monkeypatch.setattr(translation, 'generate_translations', lambda *args, **kwargs: hyps)
  full = ml_collections.ConfigDict({'model': {'arch': 'encoder_decoder'}, 'data': config})
  result = translation.translate(full, None, examples, tok)
  assert result['exact_match'] == pytest.approx(2 / 3)
  assert result['samples'][2]['output'] == 'Die katze sieht.'
  refs = [e['target'] for e in examples]
  assert result['bleu'] == pytest.approx(translation.bleu(
      [refs[0], refs[1], 'Die katze sieht.'], refs))
  assert translation.bleu(refs, refs) == pytest.approx(100.0) and 0 < result['bleu'] < 100


# --- Bad inputs: one DataError line naming the file (and line); data_dir left as it was. -------

def _bad(tmp_path, name, content):
  path = tmp_path / name
  path.write_bytes(content)
  return str(path)


BAD_FILES = [
    # (train file content, words the line must hold)
    (b'The cat.\tDie katze.\nThe dog sees the cat.\n', ['line 2', 'no tab', 'source<TAB>target']),
    (b'A\tB\nThe cat.\tDie\tkatze.\n', ['line 2', '2 tabs']),
    (b'A\tB\n\nC\tD\n\tDie katze.\n', ['line 4', 'empty source']),
    (b'', ['is empty']),
    (b'\n \n\n', ['is empty']),
    (b'The cat.\tDie katze.\nThe caf\xe9.\tDas caf\xe9.\n', ['line 2', 'not UTF-8', '0xe9']),
]


@pytest.mark.parametrize('content,needles', BAD_FILES)
def test_bad_file_is_one_line_naming_file_and_line(corpus, tmp_path, content, needles):
  path = _bad(tmp_path, 'train.tsv', content)
  data_dir = tmp_path / 'data'
  config = data_config(dict(corpus, train=path), data_dir)
  with pytest.raises(pipeline.DataError) as e:
    pipeline.get_tokenizer(config)
  message = str(e.value)
  assert '\n' not in message and f'data.files.train={path}' in message
  for needle in needles:
    assert needle in message, message
  assert not data_dir.exists()


def test_missing_file_and_vocab_too_large(corpus, tmp_path):
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  (data_dir / 'keep.txt').write_text('mine')  # a data_dir in use keeps what it held
  config = data_config(dict(corpus, test=str(tmp_path / 'nope.tsv')), data_dir)
  with pytest.raises(pipeline.DataError, match=r'data.files.test=.*nope.tsv: no such file'):
    pipeline.get_tokenizer(config)
  config = data_config(corpus, data_dir, vocab_size=5000)
  with pytest.raises(pipeline.DataError) as e:
    pipeline.get_tokenizer(config)
  assert '\n' not in str(e.value) and 'data.vocab_size=5000' in str(e.value)
  assert 'Please set it to a value <=' in str(e.value)  # SentencePiece's own limit
  assert sorted(os.listdir(data_dir)) == ['keep.txt']


def test_text_lm_empty_and_non_utf8_files(lm_corpus, tmp_path):
  for content, needle in ((b'', 'is empty'), (b'fine\n\xff\xfe\n', 'line 2: not UTF-8')):
    path = _bad(tmp_path, 'validation.txt', content)
    config = data_config(dict(lm_corpus, validation=path), tmp_path / 'data', task='text_lm')
    with pytest.raises(pipeline.DataError, match=f'data.files.validation={path}.*{needle}'):
      pipeline.get_tokenizer(config)
    assert not (tmp_path / 'data').exists()


def _full_config(task='text_pairs', arch='encoder_decoder', **data):
  from configs import default
  config = default.get_config('quick')
  config.model.arch = arch
  config.data.task = task
  config.data.files.update({'train': 'a.tsv', 'validation': 'b.tsv', 'test': 'c.tsv'})
  config.data.update(data)
  return validation.resolve(config)


@pytest.mark.parametrize('change,needle', [
    (dict(files={'train': '', 'validation': 'b', 'test': 'c'}), 'data.files.train='),
    (dict(vocab_size=6), 'data.vocab_size=6 must be an integer > 6'),
    (dict(vocab_size=True), 'data.vocab_size=True'),
    (dict(shared_vocab='yes'), "data.shared_vocab='yes' must be True or False"),
    (dict(task='text_lm'), "model.arch='encoder_decoder'; valid archs: decoder_only"),
    (dict(task='text_lmm'), "data.task='text_lmm' is not valid"),
])
def test_validation_of_text_fields(change, needle):
  config = _full_config()
  files = change.pop('files', None)
  if files:
    config.data.files.update(files)
  with config.data.ignore_type():  # wrong types, as a config.json or a config file may hold
    config.data.update(change)
  with pytest.raises(options.ConfigError, match=None) as e:
    validation.validate(config)
  assert needle in str(e.value), str(e.value)


def test_example_configs_validate():
  from training import config_file
  for name, suffix in (('text_pairs', 'tsv'), ('text_lm', 'txt')):
    config = config_file.load_config_file(f'{ROOT}/configs/{name}.py:dir=/corpus,quick')
    assert config.data.files.test == f'/corpus/test.{suffix}'
    validation.validate(validation.resolve(config))


def test_tokenizer_does_not_depend_on_the_host(monkeypatch):
  """Every host of a multi-host run trains its own copy: the model must not follow the core count
  (SentencePiece's result depends on its thread count)."""
  rng = random.Random(1)
  sentences = [s for _ in range(1500) for s in sample_pair(rng)]
  models = []
  for cores in (1, 16):
    monkeypatch.setattr(os, 'cpu_count', lambda cores=cores: cores)
    models.append(spt.train(sentences, VOCAB))
  assert models[0] == models[1]


def test_accounting_counts_the_tokenizer_vocabulary(prepared, corpus, lm_corpus, tmp_path):
  """tools.accounting's V is the configured task's tokenizer's, found without preparing data."""
  from tools import accounting
  config, _ = prepared
  assert accounting.task_vocab_size(config) == pipeline.get_tokenizer(config).vocab_size == VOCAB
  separate = data_config(corpus, tmp_path / 'data', shared_vocab=False)
  assert accounting.task_vocab_size(separate) == 2 * VOCAB - 6
  assert not (tmp_path / 'data').exists()  # nothing was prepared for the count
  # (test_separate_vocabularies_share_no_id prepares this config: its tokenizer has 2 * VOCAB - 6)
  # A document has one side: one model even where shared_vocab is False.
  lm = data_config(lm_corpus, tmp_path / 'lm', task='text_lm', shared_vocab=False)
  assert accounting.task_vocab_size(lm) == VOCAB
  toy = ml_collections.ConfigDict({'task': 'base', 'data_dir': str(tmp_path / 'toy')})
  assert accounting.task_vocab_size(toy) == accounting.toy_vocab_size() != VOCAB


def _copy_corpus(corpus, directory):
  os.makedirs(directory)
  copies = {}
  for split, path in corpus.items():
    copies[split] = os.path.join(directory, os.path.basename(path))
    with open(path, 'rb') as src, open(copies[split], 'wb') as dst:
      dst.write(src.read())
  return copies


def test_a_file_changed_since_training_is_named(corpus, tmp_path):
  files = _copy_corpus(corpus, str(tmp_path / 'corpus'))
  spec = text_corpus.spec_from_config(data_config(files, tmp_path / 'data'))
  recorded = text_corpus.fingerprint(spec)
  assert recorded['folder'] == f'text_pairs/{text_corpus.folder_name(spec, recorded["hash"])}'
  assert not (tmp_path / 'data').exists()  # read, not prepared
  text_corpus.check_fingerprint(recorded, spec)
  with open(files['validation'], 'a') as f:
    f.write('\n\n')  # blank lines: the examples as read, and so the prepared folder, stay the same
  text_corpus.check_fingerprint(recorded, spec)
  with open(files['validation'], 'a') as f:
    f.write('A cat.\tEine katze.\n')
  with pytest.raises(text_corpus.DataError) as e:
    text_corpus.check_fingerprint(recorded, spec)
  line = str(e.value)
  assert line.startswith(f'data.files.validation={files["validation"]} changed since the run '
                         'started training') and recorded['folder'] in line, line
  assert '\n' not in line
  other_vocab = text_corpus.spec_from_config(data_config(corpus, tmp_path / 'data', vocab_size=64))
  with pytest.raises(text_corpus.DataError, match=f'corpus hash changed .*{recorded["hash"]}, now '
                     '[0-9a-f]{16}.* with the same files: data.vocab_size'):
    text_corpus.check_fingerprint(recorded, other_vocab)
  os.remove(files['test'])
  with pytest.raises(text_corpus.DataError, match=f'data.files.test={files["test"]}: no such file'):
    text_corpus.check_fingerprint(recorded, spec)


def _text_lm_run(workdir, files, data_dir):
  """A text_lm workdir as eval.py finds it (config.json, run_info.json), without a checkpoint."""
  from configs import text_lm
  config = validation.resolve(text_lm.get_config('quick'))
  config.data.update(data_dir=str(data_dir), vocab_size=VOCAB)
  config.data.files.update(files)
  os.makedirs(workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort())
  with open(os.path.join(workdir, 'run_info.json'), 'w') as f:
    json.dump({'corpus': text_corpus.fingerprint(text_corpus.spec_from_config(config.data))}, f)
  return config


@pytest.mark.parametrize('flag,needle', [
    (dict(translate=['test']), "--translate=test decodes target sentences; data.task='text_lm'"),
    (dict(plot_attention=2), "--plot_attention=2 draws a pair's target-to-source attention"),
    (dict(decode='beam'), '--decode=beam chooses how translations are decoded'),
    (dict(max_examples=8), '--max_examples=8 limits the examples translated'),
])
def test_eval_flags_of_sentence_pairs_are_refused_for_text_lm(lm_corpus, tmp_path, flag, needle):
  from training import eval_checks
  workdir = str(tmp_path / 'run')
  _text_lm_run(workdir, lm_corpus, tmp_path / 'data')
  run = dict(split=['test'], translate=[], lengths=[], stream_split='test', rope_scaling=None)
  eval_checks.check_eval_run(workdir, **run)  # loss and perplexity of a text_lm run: fine
  with pytest.raises(options.ConfigError) as e:
    eval_checks.check_eval_run(workdir, **{**run, **flag})
  assert str(e.value).startswith(needle) and str(e.value).endswith('valid: ' + {
      'translate': 'leave it out (loss and perplexity per --split, and --lengths)',
      'decode': 'greedy (the default)'}.get(next(iter(flag)), '0')), str(e.value)
  assert not (tmp_path / 'data').exists()  # refused before anything was prepared


def test_eval_and_resume_refuse_a_changed_file(lm_corpus, tmp_path):
  from training import eval_checks
  from training import train_checks
  files = _copy_corpus(lm_corpus, str(tmp_path / 'corpus'))
  workdir = str(tmp_path / 'run')
  config = _text_lm_run(workdir, files, tmp_path / 'data')
  run = dict(split=['test'], translate=[], lengths=[], stream_split='test', rope_scaling=None)
  eval_checks.check_eval_run(workdir, **run)
  train_checks.check_corpus(config, workdir)
  with open(files['train'], 'a') as f:
    f.write('The dog reads a new line.\n')
  needle = f'data.files.train={files["train"]} changed since the run started training'
  with pytest.raises(options.ConfigError, match=needle):  # eval.py: one line, exit 2
    eval_checks.check_eval_run(workdir, **run)
  with pytest.raises(text_corpus.DataError, match=needle):  # train.py: 'data error', exit 2
    train_checks.check_corpus(config, workdir)
  train_checks.check_corpus(config, str(tmp_path / 'new_run'))  # a new workdir: nothing to compare
  assert not (tmp_path / 'data').exists()
