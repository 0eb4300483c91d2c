"""data.tokenizer, a Hugging Face tokenizer.json (data/hf_tokenizer.py): its special ids from the
config files, the text_lm and passkey rows laid out with them (ids far from the toy 0..5, so a
constant left anywhere would show), the prepared-dataset key, and the one-line refusals. The
tokenizer is a small byte-level BPE trained here by the `tokenizers` library (no download)."""

import json
import os
import random

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, pre_tokenizers, processors, trainers

import models
from configs import default
from data import hf_tokenizer
from data import passkey
from data import passkey_text
from data import pipeline
from data import text_corpus
from layers import options
from training import retrieval
from training import validation

WORDS = ('the a cat dog sat ran on under big small red blue house tree river stone bird sang old '
         'new green tall').split()


def lines(count, seed):
  """`count` sentences of WORDS, seeded."""
  rng = random.Random(seed)
  return [' '.join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + '.'
          for _ in range(count)]


def write_tokenizer(folder, *, bos=True, pad=False, config='tokenizer_config.json', mask=False):
  """A byte-level BPE tokenizer.json with `<s>`, `</s>` (and `<pad>`, `<mask>`) appended after
  the words (ids far from 0..5), a Llama-like post-processor that adds `<s>`, and the config file
  naming them (the eos as a {"content": ...} dict); also train/validation/test.txt documents.
  Returns the folder."""
  os.makedirs(folder, exist_ok=True)
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(lines(60, 0) + [passkey_text.NEEDLE.format(key=12345),
                                          passkey_text.QUESTION + '67890'], trainer)
  specials = ['<s>', '</s>'] + ['<pad>'] * pad + ['<mask>'] * mask
  tok.add_special_tokens(specials)
  tok.post_processor = processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', tok.token_to_id('<s>'))])
  tok.save(os.path.join(folder, 'tokenizer.json'))
  named = {'eos_token': {'content': '</s>', 'special': True}}
  named.update({'bos_token': '<s>'} if bos else {'bos_token': None})
  named.update({'pad_token': '<pad>'} if pad else {})
  named.update({'mask_token': '<mask>'} if mask else {})
  with open(os.path.join(folder, config), 'w') as f:
    json.dump(named, f)
  for split, count in (('train', 80), ('validation', 16), ('test', 16)):
    with open(os.path.join(folder, f'{split}.txt'), 'w') as f:
      f.write('\n'.join(lines(count, split)) + '\n')
  return str(folder)


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  return write_tokenizer(tmp_path_factory.mktemp('hf'))


@pytest.fixture(scope='module')
def qwen_dir(tmp_path_factory):
  """No bos (as Qwen), a pad of its own, the names in special_tokens_map.json."""
  return write_tokenizer(tmp_path_factory.mktemp('qwen'), bos=False, pad=True,
                         config='special_tokens_map.json')


def data_config(folder, data_dir, task='text_lm', **fields):
  config = default.get_config().data
  config.update(task=task, tokenizer=folder, data_dir=str(data_dir), **fields)
  config.files.update({s: os.path.join(folder, f'{s}.txt') for s in text_corpus.SPLITS})
  return config


def test_round_trip_and_special_ids_from_the_files(hf_dir):
  tok = hf_tokenizer.HFTokenizer.load(hf_dir)
  raw = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, 'tokenizer.json'))
  assert (tok.bos_id, tok.eos_id) == (raw.token_to_id('<s>'), raw.token_to_id('</s>'))
  assert tok.bos_id > 300 and tok.pad_id == tok.eos_id  # no pad: the eos pads (Llama)
  assert (tok.sep_id, tok.mask_id, tok.unk_id) == (None, None, None)
  assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == tok.eos_id + 1
  for text in lines(20, 'round trip') + ['The pass key is 71432. Remember it.']:
    ids = tok.encode(text)
    assert raw.encode(text).ids == [tok.bos_id] + ids  # its post-processor's bos is not ours
    assert tok.decode(ids) == text
  ids = tok.encode('the cat sat.')
  assert tok.decode(ids + [tok.eos_id] + ids, stop_at_eos=True) == 'the cat sat.'
  assert tok.decode([tok.bos_id] + ids, skip_special=True) == 'the cat sat.'
  assert tok.decode([tok.bos_id] + ids) == '<s>the cat sat.'
  assert tok.tokens[tok.eos_id] == '</s>'


def test_no_bos_a_pad_of_its_own_and_the_special_tokens_map(qwen_dir):
  tok = hf_tokenizer.HFTokenizer.load(qwen_dir)
  raw = tokenizers.Tokenizer.from_file(os.path.join(qwen_dir, 'tokenizer.json'))
  assert tok.bos_id is None and tok.pad_id == raw.token_to_id('<pad>') != tok.eos_id
  ids = models.SpecialIds.from_tokenizer(tok)
  assert (ids.pad, ids.bos, ids.eos, ids.sep, ids.first_word) == (
      tok.pad_id, tok.eos_id, tok.eos_id, tok.eos_id, 0)


def test_a_workdir_of_the_import_and_the_content_hash(hf_dir, qwen_dir, tmp_path):
  workdir = tmp_path / 'imported'
  os.makedirs(workdir / 'tokenizer')
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    with open(os.path.join(hf_dir, name), 'rb') as f:
      (workdir / 'tokenizer' / name).write_bytes(f.read())
  assert hf_tokenizer.resolve(str(workdir)) == str(workdir / 'tokenizer')
  assert hf_tokenizer.resolve(hf_dir) == hf_dir
  assert hf_tokenizer.content_hash(str(workdir / 'tokenizer')) == hf_tokenizer.content_hash(hf_dir)
  assert hf_tokenizer.content_hash(qwen_dir) != hf_tokenizer.content_hash(hf_dir)
  with pytest.raises(hf_tokenizer.TokenizerError, match='holds no tokenizer.json') as e:
    hf_tokenizer.resolve(str(tmp_path))
  assert '\n' not in str(e.value)


def _documents(folder, split):
  with open(os.path.join(folder, f'{split}.txt')) as f:
    return [line.strip() for line in f if line.strip()]


@pytest.mark.parametrize('which', ['bos', 'no_bos'])
def test_text_lm_rows_take_the_tokenizer_ids(hf_dir, qwen_dir, tmp_path, which):
  folder = hf_dir if which == 'bos' else qwen_dir
  config = data_config(folder, tmp_path / 'data', max_length=24)
  tok = pipeline.get_tokenizer(config)
  assert isinstance(tok, hf_tokenizer.HFTokenizer)
  head = [] if tok.bos_id is None else [tok.bos_id]
  expected = [head + tok.encode(d) + [tok.eos_id] for d in _documents(folder, 'validation')]
  expected = [e for e in expected if len(e) - 1 <= 24]
  batch = next(pipeline.make_iterator(config, 'validation', len(expected), shuffle=False,
                                      repeat=False, loss_on='all'))
  for row, want in zip(range(len(expected)), expected):
    n = len(want) - 1
    np.testing.assert_array_equal(batch['inputs'][row][:n], want[:-1])
    np.testing.assert_array_equal(batch['targets'][row][:n], want[1:])
    assert (batch['inputs'][row][n:] == tok.pad_id).all()
    np.testing.assert_array_equal(batch['weights'][row], np.arange(24) < n)
  tokens, in_target = pipeline.stream_tokens(config, 'validation')
  np.testing.assert_array_equal(tokens[:len(expected[0])], expected[0])
  first = in_target[:len(expected[0])]  # the first document's: all but its bos
  np.testing.assert_array_equal(first, np.arange(len(first)) >= len(head))


def test_two_tokenizers_never_share_a_prepared_folder(hf_dir, qwen_dir, tmp_path):
  data_dir = tmp_path / 'data'
  first = pipeline._prepared(text_corpus.spec_from_config(data_config(hf_dir, data_dir)))
  other = pipeline._prepared(text_corpus.spec_from_config(
      data_config(qwen_dir, data_dir, files={s: os.path.join(hf_dir, f'{s}.txt')
                                             for s in text_corpus.SPLITS})))
  assert os.path.basename(first).startswith('hf-') and first != other
  with open(os.path.join(first, 'tokenizer.json'), 'rb') as a, open(
      os.path.join(hf_dir, 'tokenizer.json'), 'rb') as b:
    assert a.read() == b.read()  # the prepared folder holds the tokenizer it was encoded with
  assert pipeline._prepared(text_corpus.spec_from_config(data_config(hf_dir, data_dir))) == first
  sentencepiece = text_corpus.spec_from_config(data_config('', data_dir, vocab_size=40))
  assert text_corpus.folder_name(sentencepiece, 'x').startswith('vocab40-')


def _passkey_config(folder, tmp_path, length=64):
  return data_config(folder, tmp_path / 'data', task='passkey', max_length=length,
                     passkey_digits=5)


@pytest.mark.parametrize('which', ['bos', 'no_bos'])
def test_passkey_rows_hold_the_digit_key_in_your_text(hf_dir, qwen_dir, tmp_path, which):
  folder = hf_dir if which == 'bos' else qwen_dir
  config = _passkey_config(folder, tmp_path)
  tok = pipeline.get_tokenizer(config)
  batch = next(pipeline.make_iterator(config, 'validation', 8, shuffle=False))
  assert (batch['segment_ids'] == 1).all()  # every row exactly data.max_length tokens
  if tok.bos_id is not None:
    assert (batch['inputs'][:, 0] == tok.bos_id).all()
  for row in range(8):
    weights = batch['weights'][row]
    value = tok.decode(batch['targets'][row][weights > 0])
    assert value.isdigit() and len(value) == 5 and value[0] != '0'
    text = tok.decode(np.append(batch['inputs'][row], batch['targets'][row][-1]))
    assert f'The pass key is {value}. Remember it. {value} is the pass key.' in text
    assert text.endswith(f'What is the pass key? The pass key is {value}')
    last = np.flatnonzero(weights == 0)[-1]
    assert weights[last + 1:].all() and last + 1 < 64  # the value ends the row, alone weighted
  spec = passkey.spec_from_config(config)
  again = passkey_text.encoded_split(spec, 'validation', 4)
  assert all((a['source'] == b['source']).all() for a, b in zip(
      again, passkey_text.encoded_split(passkey.spec_from_config(config), 'validation', 4)))


def test_passkey_depth_places_the_key_and_retrieval_rows(hf_dir, tmp_path):
  spec = passkey.spec_from_config(_passkey_config(hf_dir, tmp_path))
  tok = passkey_text.tokenizer(spec)
  for depth in (0.0, 1.0):
    prompt, value = passkey_text.retrieval_examples(spec, 64, depth, 1)[0]
    text = tok.decode(prompt)
    key = tok.decode(value)
    if depth == 0.0:
      assert text.startswith(f' The pass key is {key}.')
    else:
      assert text.endswith(f'{key} is the pass key. What is the pass key? The pass key is ')
  inputs, values = retrieval._rows(spec, tok, 96, (0.0, 0.5), 6)
  assert inputs.shape == (12, 96) and (inputs[:, 0] == tok.bos_id).all()
  for row, value in zip(inputs, values):
    real = value[value >= 0]  # a shorter value is left-padded with -1
    assert (value[:len(value) - len(real)] == -1).all() and tok.decode(real).isdigit()
    np.testing.assert_array_equal(row[len(row) - len(real) + 1:], real[:-1])


def _full_config(folder, task='text_lm', arch='decoder_only', **data):
  config = default.get_config()
  config.model.arch = arch
  config.data.update(task=task, tokenizer=folder, **data)
  if task != 'passkey' or folder:
    config.data.files.update({s: os.path.join(folder or '.', f'{s}.txt')
                              for s in text_corpus.SPLITS})
  if task == 'passkey':
    config.data.max_length = 64
  return config


def test_a_good_config_validates(hf_dir):
  for task in ('text_lm', 'passkey'):
    validation.validate(validation.resolve(_full_config(hf_dir, task)))
  config = _full_config(hf_dir, 'python_code')
  config.data.files.update(train='', validation='', test='')
  validation.validate(validation.resolve(config))


REFUSALS = [
    (dict(task='base'), "data.tokenizer='{dir}' is read only by data.task text_lm, python_code, "
     "passkey (data.task='base' brings its own tokenizer); valid here: ''"),
    (dict(task='passkey', files={'train': ''}), "data.files.train='' must name a file of one "
     "document per line for data.task='passkey' with data.tokenizer"),
    (dict(task='passkey', passkey_digits=0), 'data.passkey_digits=0 must be an integer from 1 '
     'to 18'),
    (dict(task='passkey', max_length=20), 'data.max_length=20 cannot hold the pass key sentences '
     'and a filler token ('),
    (dict(arch='encoder_only'), "data.tokenizer='{dir}' has no mask_token, which "
     "model.arch='encoder_only' masks its inputs with"),
]


@pytest.mark.parametrize('change,needle', REFUSALS, ids=[str(c) for c, _ in REFUSALS])
def test_refusals_are_one_line(hf_dir, change, needle):
  change = dict(change)
  arch = change.pop('arch', 'decoder_only')
  files = change.pop('files', {})
  config = _full_config(hf_dir, change.pop('task', 'text_lm'), arch)
  config.data.update(change)
  config.data.files.update(files)
  with pytest.raises(options.ConfigError) as e:
    validation.validate(validation.resolve(config))
  assert str(e.value).startswith(needle.format(dir=hf_dir)) and '\n' not in str(e.value), e.value


def test_a_folder_without_a_tokenizer_or_an_eos_is_one_line(hf_dir, tmp_path):
  with pytest.raises(options.ConfigError, match=f"data.tokenizer='{tmp_path}' holds no "
                     'tokenizer.json .*valid: a folder with a Hugging Face tokenizer.json'):
    validation.validate(validation.resolve(_full_config(str(tmp_path))))
  broken = tmp_path / 'no_eos'
  os.makedirs(broken)
  with open(os.path.join(hf_dir, 'tokenizer.json'), 'rb') as f:
    (broken / 'tokenizer.json').write_bytes(f.read())
  (broken / 'tokenizer_config.json').write_text('{"bos_token": "<s>"}')
  with pytest.raises(options.ConfigError, match='no eos_token in tokenizer_config.json or '
                     'special_tokens_map.json') as e:
    validation.validate(validation.resolve(_full_config(str(broken))))
  assert '\n' not in str(e.value)
  (broken / 'tokenizer_config.json').write_text('{"eos_token": "<eot>"}')
  with pytest.raises(options.ConfigError, match="the eos_token '<eot>' of the tokenizer config "
                     'is not in tokenizer.json'):
    validation.validate(validation.resolve(_full_config(str(broken))))


def test_toy_ids_are_the_constants():
  """Toy and SentencePiece rows keep the constant ids (the default layout)."""
  from data import tokenizer as tokenizer_lib
  toy = tokenizer_lib.Tokenizer.from_words(['a', 'b'])
  assert pipeline.layout_ids(toy) == pipeline.TOY_IDS == pipeline.LayoutIds(1, 2, 3, 0)


def test_python_code_reaches_it_as_written(hf_dir, tmp_path):
  """The stdlib corpus's `␊`/`·` marks are SentencePiece's; a Hugging Face tokenizer reads the
  newlines and indentation themselves."""
  from data import python_code
  config = data_config(hf_dir, tmp_path / 'data', task='python_code', code_max_files=2,
                       packing='stream')
  config.files.update(train='', validation='', test='')
  tok = pipeline.get_tokenizer(config)
  tokens, _ = pipeline.stream_tokens(config, 'validation')
  corpus = python_code.corpus_of(config)
  with open(os.path.join(corpus.folder, 'validation.txt'), encoding='utf-8') as f:
    first = f.readline().rstrip('\n')
  end = int(np.flatnonzero(tokens == tok.eos_id)[0])
  assert tokens[0] == tok.bos_id
  assert tok.decode(tokens[1:end]) == python_code.decode_document(first)
  assert '\n' in python_code.decode_document(first) and python_code.NEWLINE in first


def test_a_changed_tokenizer_is_refused_against_the_run(hf_dir, qwen_dir, tmp_path):
  """What a run recorded of its corpus names the tokenizer's files: another tokenizer on the same
  files is refused in one line (eval.py and a resume check it)."""
  spec = text_corpus.spec_from_config(data_config(hf_dir, tmp_path / 'data'))
  recorded = text_corpus.fingerprint(spec)
  text_corpus.check_fingerprint(recorded, spec)
  files = {s: os.path.join(hf_dir, f'{s}.txt') for s in text_corpus.SPLITS}
  other = text_corpus.spec_from_config(data_config(qwen_dir, tmp_path / 'data', files=files))
  with pytest.raises(text_corpus.DataError, match='with the same files: .*data.tokenizer') as e:
    text_corpus.check_fingerprint(recorded, other)
  assert '\n' not in str(e.value)


def test_accounting_counts_its_vocabulary(hf_dir, tmp_path):
  from tools import accounting
  vocab = hf_tokenizer.HFTokenizer.load(hf_dir).vocab_size
  for task in ('text_lm', 'passkey'):
    assert accounting.task_vocab_size(data_config(hf_dir, tmp_path / 'data', task=task)) == vocab
  assert not (tmp_path / 'data').exists()  # read from the tokenizer, nothing prepared
