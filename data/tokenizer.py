"""Word-level tokenizer with fixed special ids, saved as JSON next to the dataset.

Every tokenizer of data/ (this one, `data.sentencepiece_tokenizer.SentencePieceTokenizer`) offers
the same interface: `pad_id` ... `unk_id` (the ids below), `vocab_size`, `tokens` (id -> piece),
`encode_source(text)`, `encode_target(text)` and `decode(ids, stop_at_eos=, skip_special=)`.
"""

import json
import os

PAD, BOS, EOS, SEP, MASK, UNK = 0, 1, 2, 3, 4, 5
SPECIAL_TOKENS = ('<pad>', '<bos>', '<eos>', '<sep>', '<mask>', '<unk>')  # index = id


class Tokenizer:
  """Maps space-separated words to ids; ids 0-5 are the special tokens, then the words sorted."""

  pad_id, bos_id, eos_id, sep_id, mask_id, unk_id = PAD, BOS, EOS, SEP, MASK, UNK

  def __init__(self, tokens: list[str]):
    """Builds the tokenizer from the full id -> token list (specials included)."""
    if tuple(tokens[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
      raise ValueError(f'tokens must start with {SPECIAL_TOKENS}, got {tokens[:6]}')
    if len(set(tokens)) != len(tokens):
      raise ValueError('tokens must be unique')
    self.tokens = list(tokens)
    self._ids = {token: i for i, token in enumerate(self.tokens)}

  @classmethod
  def from_words(cls, words) -> 'Tokenizer':
    """Returns a tokenizer for the given words (sorted, so the ids do not depend on their order)."""
    return cls(list(SPECIAL_TOKENS) + sorted(set(words)))

  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  def encode(self, text: str) -> list[int]:
    """Returns the ids of the space-separated words of text; unknown words map to <unk>."""
    return [self._ids.get(word, UNK) for word in text.split()]

  # One vocabulary serves both sides of the toy pairs.
  encode_source = encode_target = encode

  def decode(self, ids, *, stop_at_eos: bool = False, skip_special: bool = False) -> str:
    """Returns the words of ids joined by spaces.

    Args:
      ids: a sequence of ints (list or 1-D array).
      stop_at_eos: drop the first <eos> and everything after it.
      skip_special: drop every special token, not only <pad>.

    Returns:
      The text; <pad> is always dropped.
    """
    words = []
    for i in ids:
      i = int(i)
      if i == EOS and stop_at_eos:
        break
      if i == PAD or (skip_special and i < len(SPECIAL_TOKENS)):
        continue
      words.append(self.tokens[i])
    return ' '.join(words)

  def save(self, path: str) -> None:
    """Writes the tokenizer as JSON; atomic so that a reader never sees half a file."""
    tmp = f'{path}.tmp{os.getpid()}'
    try:
      with open(tmp, 'w') as f:
        json.dump({'tokens': self.tokens}, f, indent=0)
      os.replace(tmp, path)
    finally:
      if os.path.exists(tmp):  # a failed write (a full disk) leaves no stray file
        os.remove(tmp)

  @classmethod
  def load(cls, path: str) -> 'Tokenizer':
    """Reads a tokenizer written by save."""
    with open(path) as f:
      return cls(json.load(f)['tokens'])
