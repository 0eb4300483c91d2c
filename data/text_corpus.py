"""Your own corpus: TSV sentence pairs (text_pairs) or one document per line (text_lm), prepared
once as a TFDS dataset (array_record, no TensorFlow) with a SentencePiece tokenizer beside it.

The prepared folder is `data_dir/<task>/vocab<V>-<shared|separate>-<hash>`, the hash covering the
examples as read (stripped pairs or documents) and the vocabulary settings: the same inputs reuse
it, changed files or another vocab_size get a folder of their own. It is written in a hidden
sibling folder and renamed when
complete, so a bad input or a crash leaves nothing half-written in data_dir.
"""

import dataclasses
import fcntl
import glob
import hashlib
import json
import os
import shutil
import tempfile

from etils import epath
import tensorflow_datasets as tfds

from data import hf_tokenizer
from data import preparation
from data import sentencepiece_tokenizer as spt

TASKS = ('text_pairs', 'text_lm')
SPLITS = ('train', 'validation', 'test')
CORPUS_FILE = 'corpus.json'  # what the folder was prepared from (files, counts, vocab, hash)
FORMAT_VERSION = 1  # bump when the preparation changes: old folders are then left unused
CACHE = os.path.join(tempfile.gettempdir(), 'attnlab_data')  # local copies of gs:// data_dirs


class DataError(ValueError):
  """A bad input file or data setting; the message is one line naming the file (and line)."""


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
  """A user corpus as the config names it (hashable: the pipeline caches by it).

  Attributes:
    task: 'text_pairs' or 'text_lm'.
    data_dir: root where prepared corpora live: an absolute local path, or gs://.
    files: (train, validation, test) paths, local or gs://.
    vocab_size: pieces of each SentencePiece model, specials included.
    shared_vocab: text_pairs: one model for both sides (else one per side).
    tokenizer: a folder holding a Hugging Face tokenizer.json (data.tokenizer, resolved), used
      instead of training SentencePiece; '' for SentencePiece.
    tokenizer_hash: the content hash of that tokenizer's files ('' without one).
    code: the documents are source files with python_code's marks (`␊`, `·`), which a Hugging
      Face tokenizer reads as the newlines and spaces they stand for.
  """
  task: str
  data_dir: str
  files: tuple[str, str, str]
  vocab_size: int
  shared_vocab: bool = True
  tokenizer: str = ''
  tokenizer_hash: str = ''
  code: bool = False

  @property
  def pairs(self) -> bool:
    return self.task == 'text_pairs'

  @property
  def shared(self) -> bool:
    return self.shared_vocab or not self.pairs  # a document has one side


def spec_from_config(data_config) -> CorpusSpec:
  """The CorpusSpec of a data config with task text_pairs or text_lm.

  Raises:
    DataError: a file of data.files unset.
  """
  files = data_config.get('files', None) or {}
  paths = tuple(str(files.get(split, '') or '') for split in SPLITS)
  for split, path in zip(SPLITS, paths):
    if not path.strip():
      raise DataError(f'data.files.{split} is not set; data.task={data_config.task!r} needs '
                      f'data.files.{{{",".join(SPLITS)}}} (local paths or gs://)')
  data_dir = str(data_config.get('data_dir', './tfds_data'))
  if '://' not in data_dir:
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
  return CorpusSpec(task=data_config.task, data_dir=data_dir, files=paths,
                    vocab_size=data_config.get('vocab_size', 1000),
                    shared_vocab=bool(data_config.get('shared_vocab', True)),
                    **tokenizer_fields(data_config))


def tokenizer_fields(data_config) -> dict:
  """{'tokenizer': resolved folder, 'tokenizer_hash': its content hash} of data.tokenizer (both ''
  when unset: the task's own tokenizer).

  Raises:
    DataError: data.tokenizer names a folder without tokenizer.json.
  """
  folder = str(data_config.get('tokenizer', '') or '')
  if not folder:
    return {'tokenizer': '', 'tokenizer_hash': ''}
  try:
    folder = hf_tokenizer.resolve(folder)
  except hf_tokenizer.TokenizerError as e:
    raise DataError(str(e)) from None
  return {'tokenizer': folder, 'tokenizer_hash': hf_tokenizer.content_hash(folder)}


def load_hf_tokenizer(folder: str) -> hf_tokenizer.HFTokenizer:
  """The Hugging Face tokenizer of a resolved data.tokenizer folder; DataError for a bad one."""
  try:
    return hf_tokenizer.HFTokenizer.load(folder)
  except (hf_tokenizer.TokenizerError, ValueError) as e:
    raise DataError(str(e).splitlines()[0]) from None


# --- Reading and checking the user's files ----------------------------------------------------

def _read_text(path: str, name: str) -> str:
  """The file's text, strictly UTF-8; a DataError names the file and the line of a bad byte."""
  try:
    raw = epath.Path(path).read_bytes()
  except FileNotFoundError:
    raise DataError(f'{name}={path}: no such file') from None
  except IsADirectoryError:
    raise DataError(f'{name}={path} is a directory; valid: a text file') from None
  except OSError as e:
    raise DataError(f'{name}={path} cannot be read ({e.strerror or e})') from None
  try:
    text = raw.decode('utf-8-sig')  # a byte-order mark (some Windows editors) is not text
  except UnicodeDecodeError as e:
    line = raw[:e.start].count(b'\n') + 1
    raise DataError(f'{name}={path} line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset '
                    f'{e.start}); valid: UTF-8 text') from None
  if '\r' in text.rstrip('\r') and '\n' not in text:  # several lines, none ended by LF
    raise DataError(f'{name}={path} ends its lines with CR alone (old Mac line endings); valid: '
                    'LF or CRLF line endings (e.g. convert it with: tr "\\r" "\\n")')
  return text


def _lines(text: str):
  """(line number, line) of the non-blank lines; a '\\r' before '\\n' (Windows files) dropped."""
  for number, line in enumerate(text.split('\n'), 1):
    line = line.removesuffix('\r')
    if line.strip():
      yield number, line


def read_pairs(path: str, name: str) -> list[tuple[str, str]]:
  """Reads `source<TAB>target` lines (blank lines skipped).

  Args:
    path: a local or gs:// path.
    name: the config field that named it, for the messages (e.g. 'data.files.train').

  Raises:
    DataError: the first bad line, or an empty file, in one line.
  """
  pairs = []
  for number, line in _lines(_read_text(path, name)):
    fields = line.split('\t')
    if len(fields) != 2:
      what = 'no tab' if len(fields) == 1 else f'{len(fields) - 1} tabs'
      raise DataError(f'{name}={path} line {number}: {what}; valid: source<TAB>target, one pair '
                      'per line')
    source, target = (f.strip() for f in fields)
    if not source or not target:
      raise DataError(f'{name}={path} line {number}: empty {"source" if not source else "target"}'
                      '; valid: source<TAB>target, both non-empty')
    pairs.append((source, target))
  if not pairs:
    raise DataError(f'{name}={path} is empty; valid: source<TAB>target lines')
  return pairs


def read_documents(path: str, name: str) -> list[str]:
  """Reads one document per line (blank lines skipped); DataError for an empty file."""
  docs = [line.strip() for _, line in _lines(_read_text(path, name))]
  if not docs:
    raise DataError(f'{name}={path} is empty; valid: one document per line')
  return docs


def read_corpus(spec: CorpusSpec) -> tuple[dict[str, list], str]:
  """Reads and checks every file of spec; returns ({split: examples}, hash of files + settings).

  An example is a (source, target) pair for text_pairs, a document (str) for text_lm.
  """
  settings = [FORMAT_VERSION, spec.task, spec.vocab_size, spec.shared]
  if spec.tokenizer:  # the tokenizer's files, not vocab_size, say what the ids are
    settings = [FORMAT_VERSION, spec.task, 'hf', spec.tokenizer_hash]
  digest = hashlib.sha256(json.dumps(settings).encode())
  splits = {}
  for split, path in zip(SPLITS, spec.files):
    name = f'data.files.{split}'
    splits[split] = read_pairs(path, name) if spec.pairs else read_documents(path, name)
    digest.update(json.dumps(splits[split], ensure_ascii=False).encode())
  return splits, digest.hexdigest()[:16]


def folder_name(spec: CorpusSpec, digest: str) -> str:
  """`vocab<V>-<shared|separate>-<hash>`: the settings readable, the hash telling inputs apart;
  `hf-<hash>` with a Hugging Face tokenizer (the hash covers its files)."""
  if spec.tokenizer:
    return f'hf-{digest}'
  return f'vocab{spec.vocab_size}-{"shared" if spec.shared else "separate"}-{digest}'


def tokenizer_vocab_size(spec: CorpusSpec) -> int:
  """V of the tokenizer `prepare` makes for spec, known without preparing anything.

  SentencePiece's trainer gives each model exactly spec.vocab_size pieces (or fails), and two
  models share only the special ids (`spt.SentencePieceTokenizer`: V_source + V_target - 6).
  A Hugging Face tokenizer's V is its own.
  """
  if spec.tokenizer:
    return load_hf_tokenizer(spec.tokenizer).vocab_size
  return spec.vocab_size if spec.shared else 2 * spec.vocab_size - spt.NUM_SPECIAL


# --- What a run trained on --------------------------------------------------------------------

_FINGERPRINTS = {}  # CorpusSpec -> its fingerprint as this process's `prepare` last read the files


def _fingerprint(spec, splits, digest):
  # A hash per file besides the folder's, so that a mismatch can name the file that changed.
  hashes = {split: hashlib.sha256(json.dumps(examples, ensure_ascii=False).encode())
            .hexdigest()[:16] for split, examples in splits.items()}
  return {'hash': digest, 'folder': f'{spec.task}/{folder_name(spec, digest)}',
          'files': dict(zip(SPLITS, spec.files)), 'file_hashes': hashes}


def fingerprint(spec: CorpusSpec) -> dict:
  """What a run records of its corpus (run_info.json 'corpus'): the prepared folder's hash and
  name, and each file's path and the hash of its examples as read.

  The files as this process's `prepare` read them (no second read), else read now.
  """
  if spec not in _FINGERPRINTS:
    _FINGERPRINTS[spec] = _fingerprint(spec, *read_corpus(spec))
  return _FINGERPRINTS[spec]


def check_fingerprint(recorded: dict, spec: CorpusSpec) -> None:
  """Reads spec's files now; raises DataError unless they give the folder `recorded` was made from.

  Changed files would get a prepared folder and a tokenizer of their own, silently paired with a
  model trained on the old ones.

  Args:
    recorded: a `fingerprint` of the run's corpus when it started training.
    spec: the corpus as the run's config names it.

  Raises:
    DataError: one line naming the first file whose examples changed (or the hash, where only
      the vocabulary settings or the preparation format differ), or a file that cannot be read.
  """
  splits, digest = read_corpus(spec)
  if digest == recorded.get('hash'):
    return
  now = _fingerprint(spec, splits, digest)['file_hashes']
  was = recorded.get('file_hashes', {})
  folder = recorded.get('folder', '?')
  for split, path in zip(SPLITS, spec.files):
    if was.get(split) != now[split]:
      raise DataError(f'data.files.{split}={path} changed since the run started training (its '
                      f'examples hash {was.get(split)}, now {now[split]}; the model and tokenizer '
                      f'belong to {folder}); valid: the file as it was, or a new workdir')
  raise DataError(f'the corpus hash changed since the run started training ({recorded.get("hash")}'
                  f', now {digest}) with the same files: data.vocab_size, data.shared_vocab, '
                  f'data.tokenizer (or its files) or the preparation format '
                  f'(text_corpus.FORMAT_VERSION) differ; the model belongs to {folder}; valid: the '
                  'settings it was trained with')


# --- The TFDS builder -------------------------------------------------------------------------

class TextCorpusConfig(tfds.core.BuilderConfig):
  """One prepared corpus: its examples, already read and checked."""

  def __init__(self, *, pairs: bool, splits: dict[str, list], **kwargs):
    super().__init__(version=tfds.core.Version('1.0.0'), **kwargs)
    self.pairs = pairs
    self.splits = splits


class TextCorpus(tfds.core.GeneratorBasedBuilder):
  """A user corpus; its config carries the examples (read from the user's files beforehand)."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self) -> tfds.core.DatasetInfo:
    if self.builder_config.pairs:
      features = {'source': tfds.features.Text(), 'target': tfds.features.Text()}
    else:
      features = {'text': tfds.features.Text()}
    return tfds.core.DatasetInfo(
        builder=self, description='A user corpus (data.task=text_pairs or text_lm).',
        features=tfds.features.FeaturesDict(features),
        disable_shuffling=True)  # file order: samples and streams follow the user's files

  def _split_generators(self, dl_manager):
    del dl_manager  # The files were read (and checked) before the builder was made.
    return {split: self._generate_examples(examples)
            for split, examples in self.builder_config.splits.items()}

  def _generate_examples(self, examples):
    for i, example in enumerate(examples):
      if self.builder_config.pairs:
        yield i, {'source': example[0], 'target': example[1]}
      else:
        yield i, {'text': example}


# --- Preparation ------------------------------------------------------------------------------

def _lock_path(final_dir: str) -> str:
  # In the temp dir, not data_dir: a failed preparation must leave data_dir as it was.
  key = hashlib.sha256(final_dir.encode()).hexdigest()[:16]
  return os.path.join(tempfile.gettempdir(), f'attnlab-text-corpus-{key}.lock')


def _build(spec: CorpusSpec, splits: dict[str, list], digest: str, tmp: str) -> str:
  """Trains the tokenizer (or copies data.tokenizer's) and writes the dataset under tmp; returns
  the folder to rename."""
  tokenizer = (load_hf_tokenizer(spec.tokenizer) if spec.tokenizer
               else spt.SentencePieceTokenizer(*_train_models(spec, splits['train'])))
  builder = TextCorpus(config=TextCorpusConfig(name=f'c{digest}', pairs=spec.pairs,
                                               splits=splits),
                       data_dir=os.path.join(tmp, 'tfds'))
  tfds.disable_progress_bar()
  builder.download_and_prepare(file_format='array_record')
  dataset_dir = os.fspath(builder.data_dir)
  tokenizer.save(dataset_dir)
  record = {'format_version': FORMAT_VERSION, 'hash': digest, 'task': spec.task,
            'vocab_size': spec.vocab_size,
            'shared_vocab': spec.shared, 'tokenizer_vocab_size': tokenizer.vocab_size,
            'files': dict(zip(SPLITS, spec.files)),
            'examples': {split: len(examples) for split, examples in splits.items()}}
  if spec.tokenizer:
    record.update(tokenizer=spec.tokenizer, tokenizer_hash=spec.tokenizer_hash)
  with open(os.path.join(dataset_dir, CORPUS_FILE), 'w') as f:
    json.dump(record, f, indent=2)
  return dataset_dir


def _train_models(spec: CorpusSpec, train: list) -> list[bytes]:
  """The SentencePiece model(s) of the train split: one shared, or source and target."""
  models = []
  sides = [None] if spec.shared else [0, 1]
  for side in sides:
    if spec.pairs and side is None:
      sentences = [s for pair in train for s in pair]  # one model of both languages
    elif spec.pairs:
      sentences = [pair[side] for pair in train]
    else:
      sentences = train
    try:
      models.append(spt.train(sentences, spec.vocab_size))
    except spt.TrainingError as e:
      which = '' if side is None else f' ({("source", "target")[side]} side)'
      raise DataError(f'data.vocab_size={spec.vocab_size} does not fit data.files.train='
                      f'{spec.files[0]}{which}: SentencePiece: {e}') from None
  return models


def prepare(spec: CorpusSpec) -> str:
  """Reads and checks the files, then prepares the corpus unless its folder exists.

  Concurrent first calls (local processes, test workers) are serialised by a file lock; the folder
  appears by one rename when complete, so its existence means a complete dataset. A gs:// data_dir
  is used through a local copy (see `_prepare_remote`).

  Returns:
    The (local) prepared folder: the array_record files, dataset_info.json, the SentencePiece
    model(s) and corpus.json.

  Raises:
    DataError: a bad file or a vocab_size the corpus cannot fill, in one line; data_dir is then
      as it was (a data_dir this call created is removed again).
  """
  splits, digest = read_corpus(spec)
  _FINGERPRINTS[spec] = _fingerprint(spec, splits, digest)  # what a run records (`fingerprint`)
  if '://' in spec.data_dir:
    return _prepare_remote(spec, splits, digest)
  return _prepare_local(spec, splits, digest)


def _prepare_local(spec, splits, digest):
  task_dir = os.path.join(spec.data_dir, spec.task)
  final_dir = os.path.join(task_dir, folder_name(spec, digest))
  if os.path.isdir(final_dir):
    return final_dir
  created = [d for d in (spec.data_dir, task_dir) if not os.path.exists(d)]
  with open(_lock_path(final_dir), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if os.path.isdir(final_dir):  # another process finished meanwhile
      return final_dir
    os.makedirs(task_dir, exist_ok=True)
    prefix = f'.{os.path.basename(final_dir)}.tmp'
    for stale in glob.glob(os.path.join(glob.escape(task_dir), prefix + '*')):
      shutil.rmtree(stale, ignore_errors=True)  # a killed preparation's (the lock is ours now)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=task_dir)
    try:
      with preparation.preparing(task_dir, f'the {spec.task} corpus'):
        os.rename(_build(spec, splits, digest, tmp), final_dir)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      for d in reversed(created):  # the folders this call made, innermost first, if still empty
        if os.path.isdir(d) and not os.listdir(d):
          os.rmdir(d)
      raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return final_dir


def _prepare_remote(spec, splits, digest):
  """A gs:// data_dir: TFDS reads array_record with local file I/O, so the folder is used from a
  local cache (ATTNLAB_DATA_CACHE, as `data.remote_dir`): downloaded when the bucket holds it whole
  (corpus.json, uploaded last, marks that), else prepared locally and uploaded for the other hosts
  and later runs."""
  cache = os.path.join(os.environ.get('ATTNLAB_DATA_CACHE', CACHE),
                       spec.data_dir.rstrip('/').replace('://', '/'))
  name = f'{spec.task}/{folder_name(spec, digest)}'
  remote, local = epath.Path(spec.data_dir) / name, os.path.join(cache, name)
  if not os.path.isdir(local) and (remote / CORPUS_FILE).exists():
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(local)}.download',
                           dir=os.path.dirname(local))
    try:
      for child in remote.iterdir():  # flat: array_record files, JSON, SentencePiece models
        with open(os.path.join(tmp, child.name), 'wb') as f:
          f.write(child.read_bytes())
      if not os.path.isdir(local):  # another local process may have been quicker
        os.rename(tmp, local)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  local = _prepare_local(dataclasses.replace(spec, data_dir=cache), splits, digest)
  have = {child.name for child in remote.iterdir()} if remote.is_dir() else set()
  for file in sorted(os.listdir(local), key=lambda n: n == CORPUS_FILE):  # corpus.json last
    if file not in have:
      with open(os.path.join(local, file), 'rb') as f:
        (remote / file).write_bytes(f.read())
  return local


def load_tokenizer(dataset_dir: str):
  """The tokenizer saved beside a prepared corpus: `spt.SentencePieceTokenizer`, or
  `hf_tokenizer.HFTokenizer` for a corpus prepared with data.tokenizer."""
  if hf_tokenizer.is_saved(dataset_dir):
    return load_hf_tokenizer(dataset_dir)
  return spt.SentencePieceTokenizer.load(dataset_dir)


def read_split(dataset_dir: str, split: str) -> list[tuple[str, str]]:
  """A prepared split in file order, as (source, target); a text_lm document is ('', text)."""
  source = tfds.builder_from_directory(dataset_dir).as_data_source(split=split)
  records = source.__getitems__(range(len(source)))
  if records and 'text' in records[0]:
    return [('', r['text'].decode()) for r in records]
  return [(r['source'].decode(), r['target'].decode()) for r in records]
