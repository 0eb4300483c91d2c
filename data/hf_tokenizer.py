"""A Hugging Face tokenizer (tokenizer.json, read by the `tokenizers` package) behind the
interface of `data.tokenizer.Tokenizer`, its special ids taken from the files beside it.

The special ids are those tokenizer_config.json names (`bos_token`, `eos_token`, `pad_token`,
`sep_token`, `mask_token`, `unk_token`: strings or `{"content": ...}`; special_tokens_map.json
where tokenizer_config.json lacks them), looked up in tokenizer.json. A tokenizer without a pad
token pads with its eos (as most Llama fine-tunes do); one without a bos (Qwen) has `bos_id` None,
and its rows and prompts start without one. Text is encoded without the tokenizer's own
post-processor (`add_special_tokens=False`): the pipeline adds bos and eos where it adds them for
every tokenizer, so a Llama row never starts with two bos.
"""

import hashlib
import json

from etils import epath
import tokenizers

TOKENIZER_FILE = 'tokenizer.json'
CONFIG_FILES = ('tokenizer_config.json', 'special_tokens_map.json')  # read in this order
IMPORT_SUBDIR = 'tokenizer'  # where python -m tools.hf import copies them in its workdir
SPECIALS = ('pad', 'bos', 'eos', 'sep', 'mask', 'unk')


class TokenizerError(ValueError):
  """A folder without a usable tokenizer; the message is one line naming the folder."""


def resolve(folder: str) -> str:
  """The folder that holds tokenizer.json: `folder` itself, or `folder/tokenizer` (a workdir of
  python -m tools.hf import).

  Raises:
    TokenizerError: neither holds tokenizer.json.
  """
  path = epath.Path(folder)
  for candidate in (path, path / IMPORT_SUBDIR):
    if (candidate / TOKENIZER_FILE).is_file():
      return str(candidate)
  raise TokenizerError(f'data.tokenizer={folder!r} holds no {TOKENIZER_FILE} (nor '
                       f'{IMPORT_SUBDIR}/{TOKENIZER_FILE}); valid: a folder with a Hugging Face '
                       f'{TOKENIZER_FILE}, or a workdir written by python -m tools.hf import')


def content_hash(folder: str) -> str:
  """SHA-256 (16 hex digits) of tokenizer.json and the config files present in a resolved folder:
  two tokenizers never share a prepared dataset."""
  digest = hashlib.sha256()
  for name in (TOKENIZER_FILE,) + CONFIG_FILES:
    file = epath.Path(folder) / name
    if file.is_file():
      digest.update(name.encode() + b'\0' + hashlib.sha256(file.read_bytes()).digest())
  return digest.hexdigest()[:16]


def _token_text(value):
  """A special token as the config files write it: a string or {"content": ...}; None if unset."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) and value else None


def _named_specials(files: dict[str, bytes]) -> dict[str, str]:
  """{'bos': '<s>', ...}: the special tokens the config files name (the first file that does)."""
  named = {}
  for name in CONFIG_FILES:
    if name not in files:
      continue
    config = json.loads(files[name])
    for special in SPECIALS:
      text = _token_text(config.get(f'{special}_token'))
      if text is not None:
        named.setdefault(special, text)
  return named


class HFTokenizer:
  """A tokenizer.json with the ids of its special tokens; the interface of `data.tokenizer`.

  Attributes:
    pad_id, bos_id, eos_id, sep_id, mask_id, unk_id: the special ids (bos, sep, mask and unk None
      where the tokenizer has none; pad the eos where it has none).
    first_word_id: 0: the special ids may lie anywhere in the vocabulary (Llama's at its end).
  """

  first_word_id = 0

  def __init__(self, files: dict[str, bytes], name: str = 'data.tokenizer'):
    """Builds the tokenizer from the files' bytes ({file name: bytes}, tokenizer.json required).

    Raises:
      TokenizerError: no eos token, or a named special token missing from tokenizer.json.
    """
    self.files = dict(files)
    self._tokenizer = tokenizers.Tokenizer.from_str(files[TOKENIZER_FILE].decode('utf-8'))
    ids = {}
    for special, text in _named_specials(files).items():
      ids[special] = self._tokenizer.token_to_id(text)
      if ids[special] is None:
        raise TokenizerError(f'{name}: the {special}_token {text!r} of the tokenizer config is '
                             f'not in {TOKENIZER_FILE}; valid: tokens of its vocabulary')
    if ids.get('eos') is None:
      raise TokenizerError(f'{name}: no eos_token in {" or ".join(CONFIG_FILES)}; valid: a '
                           'tokenizer whose config names its end-of-text token')
    self.eos_id = ids['eos']
    self.pad_id = ids.get('pad', self.eos_id)
    self.bos_id, self.sep_id = ids.get('bos'), ids.get('sep')
    self.mask_id, self.unk_id = ids.get('mask'), ids.get('unk')
    self.special_ids = frozenset(i for i in ids.values() if i is not None)
    self._tokens = None

  @property
  def vocab_size(self) -> int:
    """The tokenizer's ids, added tokens included (a model's V may be larger)."""
    return self._tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def tokens(self) -> list[str]:
    """id -> token (built on first use: a large vocabulary's list costs a few MB)."""
    if self._tokens is None:
      self._tokens = [self._tokenizer.id_to_token(i) or '' for i in range(self.vocab_size)]
    return self._tokens

  def encode(self, text: str) -> list[int]:
    """The ids of text, no special tokens added."""
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  # One vocabulary serves every side.
  encode_source = encode_target = encode

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The ids of text and each token's (start, end) characters in text."""
    encoding = self._tokenizer.encode(text, add_special_tokens=False)
    return encoding.ids, encoding.offsets

  def decode(self, ids, *, stop_at_eos: bool = False, skip_special: bool = False) -> str:
    """Returns the text of ids (the tokenizer's own decoder).

    Args:
      ids: a sequence of ints (list or 1-D array).
      stop_at_eos: drop the first eos and everything after it.
      skip_special: drop every special token, not only the pad.

    Returns:
      The text; the pad is always dropped (with a pad that is the eos, the eos too).
    """
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id and stop_at_eos:
        break
      if i == self.pad_id or (skip_special and i in self.special_ids):
        continue
      out.append(i)
    return self._tokenizer.decode(out, skip_special_tokens=False)

  def save(self, directory: str) -> None:
    """Writes the tokenizer's files, as read, into directory."""
    for name, data in self.files.items():
      (epath.Path(directory) / name).write_bytes(data)

  @classmethod
  def load(cls, folder: str, name: str | None = None) -> 'HFTokenizer':
    """Reads tokenizer.json and the config files present from a resolved folder (`resolve`)."""
    files = {}
    for file in (TOKENIZER_FILE,) + CONFIG_FILES:
      path = epath.Path(folder) / file
      if path.is_file():
        files[file] = path.read_bytes()
    return cls(files, name or f'data.tokenizer={folder!r}')


def is_saved(directory: str) -> bool:
  """Whether a prepared folder holds a saved HF tokenizer."""
  return (epath.Path(directory) / TOKENIZER_FILE).is_file()
