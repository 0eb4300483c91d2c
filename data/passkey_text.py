"""Passkey retrieval in your own text (data.task=passkey with data.tokenizer): the pass key of
Mohtashami & Jaggi (2023), used by Position Interpolation (Chen et al. 2023), in filler of the
documents of data.files.train, tokenized by the Hugging Face tokenizer.

One example is one decoder-only row of exactly `length` input tokens:

    <bos> filler ... The pass key is 71432. Remember it. 71432 is the pass key. ... filler
    What is the pass key? The pass key is  ->  71432

The filler is token ids of randomly drawn documents run together and cut to fit; the sentence
with the key follows `round(depth x F)` of the F filler tokens. The key is `digits` random digits
(no leading zero). The value is the key's tokens as the tokenizer splits them after the question
(one encoding of question and key, split where the key's first digit begins), and the row weights
them alone, as the toy passkey task does. Examples are generated in memory from fixed seeds, the
same for every run of the same tokenizer, file and settings.
"""

import functools
import random

import numpy as np

from data import text_corpus

NEEDLE = ' The pass key is {key}. Remember it. {key} is the pass key.'
QUESTION = ' What is the pass key? The pass key is '
POOL_DOCS = 4096  # documents the filler is drawn from (a seeded sample of larger files)


@functools.lru_cache(maxsize=None)
def tokenizer(spec):
  """The spec's Hugging Face tokenizer (loaded once per process)."""
  return text_corpus.load_hf_tokenizer(spec.tokenizer)


@functools.lru_cache(maxsize=None)
def _pool(spec) -> tuple[np.ndarray, ...]:
  """The filler documents' token ids: data.files.train, one document per line."""
  docs = text_corpus.read_documents(spec.filler, 'data.files.train')
  if len(docs) > POOL_DOCS:
    docs = random.Random('passkey/pool').sample(docs, POOL_DOCS)
  tok = tokenizer(spec)
  pool = tuple(np.asarray(tok.encode(' ' + doc), np.int32) for doc in docs)
  pool = tuple(p for p in pool if len(p))
  if not pool:
    raise text_corpus.DataError(f'data.files.train={spec.filler} gives no tokens of filler; '
                                'valid: a file of text, one document per line')
  return pool


def _filler(rng: random.Random, pool, count: int) -> np.ndarray:
  """`count` tokens of random documents run together (the last one cut)."""
  parts, have = [], 0
  while have < count:
    parts.append(pool[rng.randrange(len(pool))])
    have += len(parts[-1])
  return np.concatenate(parts)[:count]


def _question_and_value(tok, key: str) -> tuple[list[int], list[int]]:
  """The question's ids and the key's, from one encoding split where the key begins (a token that
  also holds the space before it, as byte-level BPE writes ' 714', is the value's)."""
  ids, offsets = tok.encode_with_offsets(QUESTION + key)
  split = len(QUESTION)
  first = next(i for i, (_, end) in enumerate(offsets) if end > split)
  return ids[:first], ids[first:]


def sample_example(rng: random.Random, spec, length: int,
                   depth: float | None = None) -> tuple[np.ndarray, np.ndarray]:
  """One example of `length` row tokens: (prompt ids, value ids), the row's bos not included.

  Args:
    rng: the random generator, advanced in place.
    spec: a `data.passkey.PasskeySpec` with a tokenizer.
    length: tokens of the model's input row.
    depth: in [0, 1]: the share of the filler before the key's sentence; None: a place drawn
      uniformly from spec.depths (every place between round(low x F) and round(high x F)).

  Raises:
    DataError: `length` cannot hold the key's sentences and a filler token.
  """
  tok = tokenizer(spec)
  key = str(rng.randrange(10 ** (spec.digits - 1), 10 ** spec.digits))
  needle = tok.encode(NEEDLE.format(key=key))
  question, value = _question_and_value(tok, key)
  head = 0 if tok.bos_id is None else 1
  # The row's inputs are every token but the last: bos, filler, needle, question, value.
  overhead = head + len(needle) + len(question) + len(value)
  count = length + 1 - overhead
  if count < 1:
    raise text_corpus.DataError(
        f'passkey: a row of {length} tokens cannot hold the pass key sentences and a filler '
        f'token ({overhead} tokens with data.tokenizer={spec.tokenizer}); valid: data.max_length '
        f'(and retrieval lengths) >= {overhead}')
  if depth is None:
    at = rng.randint(*(round(d * count) for d in spec.depths))
  else:
    at = round(depth * count)
  filler = _filler(rng, _pool(spec), count)
  prompt = np.concatenate([filler[:at], needle, filler[at:], question]).astype(np.int32)
  return prompt, np.asarray(value, np.int32)


@functools.lru_cache(maxsize=None)
def encoded_split(spec, split: str, size: int) -> tuple[dict[str, np.ndarray], ...]:
  """`size` examples of a split as {'source': prompt ids, 'target': value ids}, deterministic in
  the spec and the split (cached per process)."""
  rng = random.Random(f'passkey/text/{split}')
  out = []
  for _ in range(size):
    prompt, value = sample_example(rng, spec, spec.length)
    out.append({'source': prompt, 'target': value})
  return tuple(out)


def retrieval_examples(spec, length: int, depth: float,
                       count: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """`count` evaluation examples of `length` tokens with the key at `depth`, as (prompt ids, value
  ids): the same for every run of the same settings (seeded by length and depth)."""
  rng = random.Random(f'passkey/text/retrieval/{length}/{depth:.6f}')
  return [sample_example(rng, spec, length, depth) for _ in range(count)]


def min_length(spec, samples: int = 64) -> int:
  """The shortest row that holds the key's sentences and one filler token, over `samples` keys of
  a fixed seed (a key's token count varies with its digits under some tokenizers)."""
  tok = tokenizer(spec)
  rng = random.Random('passkey/text/min_length')
  head = 0 if tok.bos_id is None else 1
  longest = 0
  for _ in range(samples):
    key = str(rng.randrange(10 ** (spec.digits - 1), 10 ** spec.digits))
    question, value = _question_and_value(tok, key)
    longest = max(longest, len(tok.encode(NEEDLE.format(key=key))) + len(question) + len(value))
  return head + longest
