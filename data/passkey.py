"""Passkey retrieval (data.task=passkey): a key and its value hidden in filler of the toy language,
asked for at the end. A TFDS builder generated locally from a seed, as the toy translation task:
nothing is downloaded.

One example is one decoder-only row of exactly `length` input tokens:

    <bos> filler ... <key> K V ... filler <query> K  ->  V

The filler is source sentences of the toy grammar (data/toy_translation.py) run together and cut
to fit. The key K is any word of the toy vocabulary; the value V is `value_tokens` words drawn
from the first `values` words of the sorted vocabulary. The `<key> K V` triple follows
`round(depth x F)` of the F filler words: depth 0 puts it right after `<bos>`, depth 1 right
before the query. Filler words may equal K or V, so only the markers say where the value is. The
row predicts V alone: its weights are 1 on the value tokens and 0 everywhere else, so loss and
accuracy measure retrieval and nothing of the filler.

The train, validation and test splits hold rows of data.max_length tokens with depths drawn
uniformly from data.passkey_depths; `retrieval_examples` generates the evaluation grid (any length,
any depth) in memory, from its own seeds.
"""

import dataclasses
import functools
import os
import random
import tempfile

import numpy as np
import tensorflow_datasets as tfds

from data import generated
from data import text_corpus
from data import tokenizer as tokenizer_lib
from data import toy_translation

TASK = 'passkey'
KEY_MARKER, QUERY_MARKER = '<key>', '<query>'
SPLITS = {'test': 1000, 'validation': 1000, 'train': 20000}  # examples per split
EVAL_DEPTHS = tuple(i / 10 for i in range(11))  # the retrieval grid's depths: 0%, 10%, ..., 100%
POOL_SIZE = 4096  # toy sentences the filler is drawn from
CACHE = os.path.join(tempfile.gettempdir(), 'attnlab_data')  # local copies of gs:// data_dirs
# The data.passkey_* fields' defaults (configs/default.py holds the same values).
DEFAULTS = {'passkey_values': 32, 'passkey_value_tokens': 1, 'passkey_depths': (0.0, 1.0),
            'passkey_digits': 5}


@functools.lru_cache(maxsize=None)
def words() -> tuple[str, ...]:
  """The toy vocabulary, sorted: the filler's, the keys' and (a prefix) the values' words."""
  return tuple(toy_translation.vocabulary())


def vocabulary() -> list[str]:
  """The tokenizer's words: the toy vocabulary and the two markers."""
  return list(words()) + [KEY_MARKER, QUERY_MARKER]


def max_values() -> int:
  """The largest value vocabulary: every word of the toy vocabulary."""
  return len(words())


def overhead(value_tokens: int) -> int:
  """Tokens of a row that are not filler: `<bos>`, the markers, the key twice, the value twice
  (the last value token is a target, not an input)."""
  return 4 + 2 * value_tokens


def min_length(value_tokens: int) -> int:
  """The shortest row with at least one filler word (so that depth means something)."""
  return overhead(value_tokens) + 1


@dataclasses.dataclass(frozen=True)
class PasskeySpec:
  """The generated task as the config names it (hashable: the pipeline caches by it).

  Attributes:
    data_dir: the local root of the TFDS data (a gs:// data_dir is read through a local cache).
    length: tokens per row (data.max_length).
    values: size of the value vocabulary (data.passkey_values).
    value_tokens: words per value (data.passkey_value_tokens).
    depths: (low, high) of the uniform training depths (data.passkey_depths).
    tokenizer: a resolved data.tokenizer folder (a Hugging Face tokenizer.json): the pass key in
      filler of your text (data/passkey_text.py); '' for the toy task.
    tokenizer_hash: the content hash of that tokenizer's files.
    filler: the file whose documents are the filler (data.files.train), with a tokenizer.
    digits: digits of the pass key (data.passkey_digits), with a tokenizer.
  """
  data_dir: str
  length: int
  values: int
  value_tokens: int
  depths: tuple[float, float]
  tokenizer: str = ''
  tokenizer_hash: str = ''
  filler: str = ''
  digits: int = 5

  @property
  def name(self) -> str:
    """The TFDS builder config name: one dataset folder per setting."""
    low, high = self.depths
    return (f'len{self.length}-values{self.values}-tokens{self.value_tokens}-'
            f'depths{low:g}-{high:g}')


def spec_from_config(data_config) -> PasskeySpec:
  """The PasskeySpec of a data config with task passkey (its fields checked by the caller)."""
  data_dir = str(data_config.get('data_dir', './tfds_data'))
  if '://' in data_dir:  # generated from a seed: each host generates its own local copy
    data_dir = os.path.join(os.environ.get('ATTNLAB_DATA_CACHE', CACHE),
                            data_dir.rstrip('/').replace('://', '/'))
  fields = {name: data_config.get(name, value) for name, value in DEFAULTS.items()}
  text = text_corpus.tokenizer_fields(data_config)
  if text['tokenizer']:
    files = data_config.get('files', None) or {}
    text.update(filler=str(files.get('train', '') or ''), digits=int(fields['passkey_digits']))
  return PasskeySpec(data_dir=os.path.abspath(os.path.expanduser(data_dir)),
                     length=int(data_config.get('max_length', 64)),
                     values=int(fields['passkey_values']),
                     value_tokens=int(fields['passkey_value_tokens']),
                     depths=tuple(float(d) for d in fields['passkey_depths']), **text)


# --- Examples --------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sentence_pool() -> tuple[tuple[str, ...], ...]:
  """POOL_SIZE source sentences of the toy grammar, from a fixed seed."""
  rng = random.Random('passkey/filler')
  spec = toy_translation.TASKS['base'].splits['train']
  return tuple(tuple(toy_translation.sample_pair(rng, spec)[0].split()) for _ in range(POOL_SIZE))


def _filler(rng: random.Random, count: int) -> list[str]:
  """`count` words of toy sentences run together (the last one cut)."""
  pool, out = _sentence_pool(), []
  while len(out) < count:
    out.extend(rng.choice(pool))
  return out[:count]


def sample_example(rng: random.Random, length: int, depth: float, values: int,
                   value_tokens: int) -> tuple[list[str], list[str]]:
  """One example of `length` row tokens with the key at `depth`.

  Args:
    rng: the random generator, advanced in place.
    length: tokens of the model's input row (`<bos>` included), at least `min_length`.
    depth: in [0, 1]: the share of the filler before `<key> K V`.
    values: the value vocabulary's size (its words: the first `values` of `words()`).
    value_tokens: words per value.

  Returns:
    (prompt, value): the prompt's words, ending with `<query> K`, and the value's words.
  """
  count = length - overhead(value_tokens)
  if count < 1 or not 0.0 <= depth <= 1.0:
    raise ValueError(f'passkey: length {length} (at least {min_length(value_tokens)}) or depth '
                     f'{depth} (in [0, 1]) out of range')
  vocab = words()
  filler = _filler(rng, count)
  at = round(depth * count)
  key = rng.choice(vocab)
  value = [rng.choice(vocab[:values]) for _ in range(value_tokens)]
  prompt = filler[:at] + [KEY_MARKER, key] + value + filler[at:] + [QUERY_MARKER, key]
  return prompt, value


def split_examples(spec: PasskeySpec, split: str) -> list[tuple[str, str]]:
  """The examples of a split as (prompt, value) texts: deterministic in the spec and the split,
  depths uniform in spec.depths: every place of the key between round(low x F) and
  round(high x F) filler words equally likely (the ends too, which rounding a uniform depth
  would halve)."""
  rng = random.Random(f'passkey/{split}')
  count = spec.length - overhead(spec.value_tokens)
  low, high = (round(d * count) for d in spec.depths)
  out = []
  for _ in range(SPLITS[split]):
    depth = rng.randint(low, high) / max(count, 1)
    prompt, value = sample_example(rng, spec.length, depth, spec.values, spec.value_tokens)
    out.append((' '.join(prompt), ' '.join(value)))
  return out


def retrieval_examples(spec: PasskeySpec, length: int, depth: float,
                       count: int) -> list[tuple[list[str], list[str]]]:
  """`count` evaluation examples of `length` tokens with the key at `depth`: the same for every run
  of the same value settings (seeded by length and depth, apart from the splits' seeds)."""
  rng = random.Random(f'passkey/retrieval/{length}/{depth:.6f}')
  return [sample_example(rng, length, depth, spec.values, spec.value_tokens)
          for _ in range(count)]


def row(prompt, value, length: int, bos: int | None = tokenizer_lib.BOS,
        pad: int = tokenizer_lib.PAD) -> dict[str, np.ndarray]:
  """The decoder-only features of one example (token ids), right-padded to `length`.

  inputs `<bos> prompt value[:-1]` (no `<bos>` where `bos` is None: a tokenizer without one),
  targets the same shifted by one, both padded with `pad`; weights 1 on the value tokens only;
  segment_ids 1 and positions 0.. on the real tokens.
  """
  head = [] if bos is None else [bos]
  tokens = np.concatenate([head, prompt, value]).astype(np.int32)
  n = len(tokens) - 1
  if n > length:
    raise ValueError(f'passkey: an example of {n} tokens does not fit a row of {length}')
  out = {name: np.full(length, pad if name in ('inputs', 'targets') else 0, np.int32)
         for name in ('inputs', 'targets', 'segment_ids', 'positions')}
  out['inputs'][:n], out['targets'][:n] = tokens[:-1], tokens[1:]
  out['segment_ids'][:n], out['positions'][:n] = 1, np.arange(n)
  out['weights'] = np.zeros(length, np.float32)
  out['weights'][n - len(value):n] = 1.0
  return out


# --- The TFDS builder ------------------------------------------------------------------------

class PasskeyConfig(tfds.core.BuilderConfig):
  """One setting of the task (length, values, depths): a dataset folder of its own."""

  def __init__(self, spec: PasskeySpec):
    super().__init__(name=spec.name, version=tfds.core.Version('1.0.0'),
                     description='Passkey retrieval in filler of the toy language.')
    self.spec = spec


class PasskeyRetrieval(tfds.core.GeneratorBasedBuilder):
  """The passkey task's splits; one builder config per setting."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description='A key and value in filler of the toy language, queried at the end.',
        features=tfds.features.FeaturesDict({'source': tfds.features.Text(),
                                             'target': tfds.features.Text()}),
        supervised_keys=('source', 'target'),
        disable_shuffling=True)  # generation order (the pipeline shuffles)

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split):
    for i, (prompt, value) in enumerate(split_examples(self.builder_config.spec, split)):
      yield i, {'source': prompt, 'target': value}


def dataset_dir(spec: PasskeySpec) -> str:
  """Where TFDS writes the spec's dataset: data_dir/passkey_retrieval/<config name>/<version>."""
  return os.path.join(spec.data_dir, 'passkey_retrieval', spec.name,
                      str(PasskeyRetrieval.VERSION))


def prepare(spec) -> str:
  """Generates the spec's dataset and tokenizer under spec.data_dir unless already there; returns
  the dataset directory (`data.generated.prepare`)."""
  builder = lambda: PasskeyRetrieval(config=PasskeyConfig(spec), data_dir=spec.data_dir)
  return generated.prepare(spec.data_dir, f'.passkey_{spec.name}.lock', dataset_dir(spec),
                           builder, vocabulary())


def load_tokenizer(spec):
  """Prepares the dataset if needed and loads its tokenizer (`data.tokenizer.Tokenizer`); with
  data.tokenizer, that Hugging Face tokenizer (nothing to prepare)."""
  if spec.tokenizer:
    return text_corpus.load_hf_tokenizer(spec.tokenizer)
  return generated.load_tokenizer(prepare(spec))


def read_split(spec, split: str) -> list[tuple[str, str]]:
  """A prepared split in generation order, as (prompt, value) texts."""
  return [(r['source'].decode(), r['target'].decode())
          for r in generated.read_records(prepare(spec), split)]
