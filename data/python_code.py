"""Real code with long-range structure (data.task=python_code): the Python standard library's own
source files, from the interpreter that runs attnlab, as documents of a text_lm corpus.

Each `.py` file under the interpreter's stdlib folder is one document; the `test`, `tests` and
`idle_test` folders and `site-packages` are left out. A file's split follows a hash of its path
relative to the stdlib folder (90% train, 5% validation, 5% test), so it does not depend on which
other files exist. Code keeps names defined hundreds of tokens earlier, indentation and matching
brackets: dependencies far beyond the toy task's ~30 tokens.

Documents are one line each (the text_lm format), so a file's text is written with two visible
marks SentencePiece keeps: every newline as `␊` (U+240A) and every space of a line's indentation
as `·` (U+00B7); tabs count as four spaces. Runs of spaces inside a line become one (SentencePiece
folds them). The three files are written once into
`data_dir/python_code/py<X.Y.Z>-<hash of the file list and contents>/{train,validation,test}.txt`
and prepared by `data.text_corpus` with a SentencePiece tokenizer, as a user's text_lm corpus.
The corpus is the PSF-licensed source of the user's own interpreter, prepared locally; attnlab
ships none of it.
"""

import dataclasses
import functools
import hashlib
import json
import os
import platform
import sysconfig

from data import preparation
from data import text_corpus

TASK = 'python_code'
SKIPPED_DIRS = ('test', 'tests', 'idle_test', 'site-packages', '__pycache__')
NEWLINE, INDENT = '\u240a', '\u00b7'
SHARES = {'train': 90, 'validation': 5, 'test': 5}  # per cent of the files, by path hash
MANIFEST = 'manifest.json'


def stdlib_dir() -> str:
  return sysconfig.get_paths()['stdlib']


@functools.lru_cache(maxsize=None)
def stdlib_files(root: str) -> tuple[str, ...]:
  """The `.py` files under `root`, relative to it, sorted; the test folders and site-packages
  left out."""
  out = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
    out += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith('.py')]
  return tuple(sorted(out))


def split_of(relpath: str) -> str:
  """The split of a file: by the first 8 bytes of the SHA-256 of its relative path."""
  bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], 'big') % 100
  if bucket < SHARES['train']:
    return 'train'
  return 'validation' if bucket < SHARES['train'] + SHARES['validation'] else 'test'


def encode_document(text: str) -> str:
  """A source file as one line: newlines as `␊`, indentation spaces as `·` (tabs as 4)."""
  lines = []
  for line in text.replace('\r\n', '\n').replace('\t', '    ').split('\n'):
    body = line.lstrip(' ')
    lines.append(INDENT * (len(line) - len(body)) + body.rstrip())
  return NEWLINE.join(lines).strip(NEWLINE)


def decode_document(line: str) -> str:
  """The inverse of `encode_document` (up to trailing spaces and folded inner runs)."""
  out = []
  for row in line.split(NEWLINE):
    body = row.lstrip(INDENT)
    out.append(' ' * (len(row) - len(body)) + body)
  return '\n'.join(out)


@dataclasses.dataclass(frozen=True)
class CodeCorpus:
  """The files of one interpreter's stdlib as prepared.

  Attributes:
    folder: where the three .txt files and the manifest are.
    python: the interpreter's version, e.g. '3.11.7'.
    files_hash: the SHA-256 (16 hex digits) of the file list and the files' contents.
    counts: {split: files}.
  """
  folder: str
  python: str
  files_hash: str
  counts: tuple[tuple[str, int], ...]

  def record(self) -> dict:
    """What a run records of its corpus (run_info.json 'python_code')."""
    return {'python': self.python, 'files_hash': self.files_hash, 'files': dict(self.counts)}


def _read(root, relpath):
  with open(os.path.join(root, relpath), 'rb') as f:
    return f.read()


@functools.lru_cache(maxsize=None)
def prepare_files(data_dir: str, max_files: int = 0, root: str | None = None) -> CodeCorpus:
  """Writes the corpus's train/validation/test files under data_dir once (reused when there);
  `max_files` > 0 keeps the first that many of each split's files (a quick corpus)."""
  root = root or stdlib_dir()
  digest = hashlib.sha256(json.dumps([platform.python_version(), max_files]).encode())
  docs = {split: [] for split in SHARES}
  for relpath in stdlib_files(root):
    split = split_of(relpath)
    if max_files and len(docs[split]) >= max_files:
      continue
    raw = _read(root, relpath)
    digest.update(relpath.encode() + b'\0' + hashlib.sha256(raw).digest())
    doc = encode_document(raw.decode('utf-8', errors='replace'))
    if doc:
      docs[split].append(doc)
  files_hash = digest.hexdigest()[:16]
  folder = os.path.join(data_dir, TASK, f'py{platform.python_version()}-{files_hash}')
  counts = tuple((split, len(d)) for split, d in docs.items())
  corpus = CodeCorpus(folder, platform.python_version(), files_hash, counts)
  if not os.path.exists(os.path.join(folder, MANIFEST)):
    with preparation.preparing(folder, 'the code corpus'):
      _write_files(folder, docs, {**corpus.record(), 'stdlib': root})
  return corpus


def _write_files(folder, docs, manifest):
  """Each split's file, then the manifest that marks them complete, each under a temporary name
  renamed when written (a temporary file a failed write leaves is removed)."""
  os.makedirs(folder, exist_ok=True)
  contents = [(f'{split}.txt', '\n'.join(lines) + '\n') for split, lines in docs.items()]
  for name, text in contents + [(MANIFEST, json.dumps(manifest, indent=1))]:
    tmp = os.path.join(folder, f'.{name}.{os.getpid()}')
    try:
      with open(tmp, 'w', encoding='utf-8') as f:
        f.write(text)
      os.replace(tmp, os.path.join(folder, name))
    finally:
      if os.path.exists(tmp):
        os.remove(tmp)


def corpus_of(data_config) -> CodeCorpus:
  """The CodeCorpus a python_code data config reads (its files written on first use)."""
  data_dir = str(data_config.get('data_dir', './tfds_data'))
  if '://' in data_dir:  # generated locally: each host writes its own copy
    data_dir = os.path.join(os.environ.get('ATTNLAB_DATA_CACHE', text_corpus.CACHE),
                            data_dir.rstrip('/').replace('://', '/'))
  return prepare_files(os.path.abspath(os.path.expanduser(data_dir)),
                       int(data_config.get('code_max_files', 0) or 0))


def spec_from_config(data_config) -> text_corpus.CorpusSpec:
  """The text_lm CorpusSpec of the prepared stdlib files (written on first use)."""
  corpus = corpus_of(data_config)
  files = tuple(os.path.join(corpus.folder, f'{split}.txt') for split in text_corpus.SPLITS)
  return text_corpus.CorpusSpec(task='text_lm', data_dir=os.path.dirname(os.path.dirname(
      corpus.folder)), files=files, vocab_size=data_config.get('vocab_size', 1000),
      code=True, **text_corpus.tokenizer_fields(data_config))
