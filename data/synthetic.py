"""Synthetic tasks that demand what an ablation varies (data.task = mqar | induction |
selective_copy | memorize): TFDS builders generated locally from a seed, as the passkey task, with
knobs that set their difficulty. Nothing is downloaded.

One example is one decoder-only row of data.max_length input tokens, `<bos>` first, whose loss and
accuracy are on the scored tokens alone (the weights are 1 there, 0 elsewhere):

- mqar, multi-query associative recall (Arora et al. 2023, "Zoology"): `pairs` key-value pairs
  `k v k v ...` (keys distinct, from `key_vocab` key words; values from `value_vocab` value
  words), then a
  region of noise (value words) in which `queries` of the keys (0 = all) are asked again, each in
  a two-token slot drawn uniformly among the region's slots and followed by its value. Scored: the
  value after each query key. A fixed-size state must hold every pair; attention looks them up.
- induction (Olsson et al. 2022): noise, a segment of `pairs` distinct tokens, more noise, and the
  segment again; the noise never uses the segment's tokens, so each token of the repeat occurred
  exactly once before, and the token that followed it there is the answer. Scored: every token of
  the repeat after its first (the repeat's start cannot be foreseen).
- selective_copy (Gu & Dao 2023, "Mamba"): `pairs` data tokens at random places of a region of
  blanks `.`, then `<copy>` and the data tokens in order. Scored: the copied tokens.
- memorize (Poli et al. 2024, "MAD"): one fixed map of `key_vocab` keys to values, drawn once
  and shared
  by every row of every split; a row is `pairs` distinct keys each followed by its value. The
  rows never tell the map, so the accuracy measures what the parameters hold. A key is two
  tokens (`key_parts` words each, key i = parts (i // P, i % P)), so that the map cannot sit in
  one embedding row per key: the network must compute it from the two parts, which is what
  feed-forward width and experts buy.

Examples are stored as two texts: the row's words after `<bos>` and the indices (in those words)
of the scored tokens.
"""

import dataclasses
import functools
import math
import os
import random
import tempfile

import numpy as np
import tensorflow_datasets as tfds

from data import generated
from data import tokenizer as tokenizer_lib

TASKS = ('mqar', 'induction', 'selective_copy', 'memorize')
SPLITS = {'test': 1000, 'validation': 1000, 'train': 20000}  # examples per split
CACHE = os.path.join(tempfile.gettempdir(), 'attnlab_data')  # local copies of gs:// data_dirs
# The data.synthetic fields and their defaults (configs/default.py holds the same values), and the
# tasks that read each field.
DEFAULTS = {'pairs': 16, 'key_vocab': 64, 'value_vocab': 64, 'queries': 0}
READ_BY = {'pairs': TASKS, 'key_vocab': ('mqar', 'memorize'), 'value_vocab': TASKS,
           'queries': ('mqar',)}
BLANK, COPY = '.', '<copy>'


def key_word(i: int) -> str:
  return f'k{i}'


def value_word(i: int) -> str:
  return f'v{i}'


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
  """A generated task as the config names it (hashable: the pipeline caches by it).

  Attributes:
    data_dir: the local root of the TFDS data (a gs:// data_dir is read through a local cache).
    task: one of TASKS.
    length: input tokens per row (data.max_length).
    pairs, key_vocab, value_vocab, queries: the data.synthetic knobs (module docstring).
  """
  data_dir: str
  task: str
  length: int
  pairs: int
  key_vocab: int
  value_vocab: int
  queries: int

  @property
  def name(self) -> str:
    """The TFDS builder config name: one dataset folder per setting."""
    return (f'{self.task}-len{self.length}-pairs{self.pairs}-keys{self.key_vocab}'
            f'-values{self.value_vocab}'
            f'-queries{self.queries}')

  @property
  def queried(self) -> int:
    """Keys asked per mqar row (queries, or every pair when 0)."""
    return self.queries or self.pairs


def spec_from_config(data_config) -> SyntheticSpec:
  """The SyntheticSpec of a data config whose task is in TASKS (its fields checked by the
  caller)."""
  data_dir = str(data_config.get('data_dir', './tfds_data'))
  if '://' in data_dir:  # generated from a seed: each host generates its own local copy
    data_dir = os.path.join(os.environ.get('ATTNLAB_DATA_CACHE', CACHE),
                            data_dir.rstrip('/').replace('://', '/'))
  knobs = data_config.get('synthetic', None) or {}
  fields = {name: int(knobs.get(name, value)) for name, value in DEFAULTS.items()}
  return SyntheticSpec(data_dir=os.path.abspath(os.path.expanduser(data_dir)),
                       task=str(data_config.get('task')),
                       length=int(data_config.get('max_length', 64)), **fields)


def vocabulary(spec: SyntheticSpec) -> list[str]:
  """The tokenizer's words: every key word a task can use, the value words and the markers."""
  keys = {'mqar': spec.key_vocab, 'memorize': key_parts(spec.key_vocab)}.get(spec.task, 0)
  return ([key_word(i) for i in range(keys)] + [value_word(i) for i in range(spec.value_vocab)]
          + [BLANK, COPY])


# --- What each setting can hold: the knobs' limits (training.validation_synthetic words them) ---

def min_length(task: str, pairs: int, queried: int = 0) -> int:
  """The shortest row (input tokens, `<bos>` included) that holds an example of the task."""
  if task == 'mqar':
    return 2 * pairs + 2 * queried  # context, then a two-token slot per query (last value: target)
  if task == 'induction':
    return 2 * pairs  # the segment twice (its last token a target only), <bos> in the noise's place
  if task == 'selective_copy':
    return 2 * pairs + 1  # as many blanks as data at least, <copy>, the copy (last: target)
  return 3 * pairs  # memorize: two key parts and a value a pair (the last value a target only)


def min_values(task: str, pairs: int) -> int:
  """The smallest value vocabulary of the task: induction needs the segment's tokens distinct and
  one more for the noise; the others two (chance at most 1/2)."""
  return pairs + 1 if task == 'induction' else 2


# --- Examples: (words after <bos>, indices of the scored words) ----------------------------------

def _mqar(rng, spec, pairs, queried):
  keys = rng.sample(range(spec.key_vocab), pairs)
  values = [rng.randrange(spec.value_vocab) for _ in range(pairs)]
  words = [w for k, v in zip(keys, values) for w in (key_word(k), value_word(v))]
  region = spec.length - len(words)  # tokens after the context (the row's L + 1 minus <bos>)
  slots = sorted(rng.sample(range(region // 2), queried))
  asked = rng.sample(range(pairs), queried)
  tail = [value_word(rng.randrange(spec.value_vocab)) for _ in range(region)]  # noise
  scored = []
  for slot, pair in zip(slots, asked):
    tail[2 * slot], tail[2 * slot + 1] = key_word(keys[pair]), value_word(values[pair])
    scored.append(len(words) + 2 * slot + 1)
  return words + tail, scored


def _induction(rng, spec, pairs, queried):
  del queried
  segment = rng.sample(range(spec.value_vocab), pairs)
  rest = sorted(set(range(spec.value_vocab)) - set(segment))
  total = spec.length  # words after <bos>: L inputs + 1 target, minus <bos>
  noise = total - 2 * pairs
  first = rng.randint(0, noise)  # noise words before the first copy
  second = rng.randint(0, noise - first)  # between the copies; the rest after the second
  words = [value_word(rng.choice(rest)) for _ in range(noise)]
  at = first + pairs + second
  words[first:first] = [value_word(t) for t in segment]
  words[at:at] = [value_word(t) for t in segment]
  return words, list(range(at + 1, at + pairs))


def _selective_copy(rng, spec, pairs, queried):
  del queried
  region = spec.length - pairs  # words after <bos>: region, <copy>, the data (L + 1 - 1)
  region -= 1
  data = [value_word(rng.randrange(spec.value_vocab)) for _ in range(pairs)]
  words = [BLANK] * region
  for place, word in zip(sorted(rng.sample(range(region), pairs)), data):
    words[place] = word
  return words + [COPY] + data, list(range(region + 1, region + 1 + pairs))


@functools.lru_cache(maxsize=None)
def memorize_map(keys: int, values: int) -> tuple[int, ...]:
  """The memorize task's fixed map (key i -> value map[i]), the same in every split and run."""
  rng = random.Random(f'memorize/map/{keys}/{values}')
  return tuple(rng.randrange(values) for _ in range(keys))


def key_parts(keys: int) -> int:
  """P, the memorize task's key-part vocabulary: the smallest with P x P >= keys."""
  return math.isqrt(keys - 1) + 1 if keys > 1 else 1


def _memorize(rng, spec, pairs, queried):
  del queried
  table, parts = memorize_map(spec.key_vocab, spec.value_vocab), key_parts(spec.key_vocab)
  words = []
  for k in rng.sample(range(spec.key_vocab), pairs):
    words += [key_word(k // parts), key_word(k % parts), value_word(table[k])]
  noise = spec.length - len(words)  # the row's remaining words: blanks, never scored
  return words + [BLANK] * noise, list(range(2, 3 * pairs, 3))


GENERATORS = {'mqar': _mqar, 'induction': _induction, 'selective_copy': _selective_copy,
              'memorize': _memorize}


def sample_example(rng: random.Random, spec: SyntheticSpec, pairs: int | None = None,
                   queried: int | None = None) -> tuple[list[str], list[int]]:
  """One example of spec.length + 1 tokens with `<bos>`: (its words after `<bos>`, the indices of
  the scored words). `pairs` and `queried` override the spec's (mqar's evaluation by pairs)."""
  pairs = spec.pairs if pairs is None else pairs
  queried = min(spec.queried, pairs) if queried is None else queried
  if spec.length < min_length(spec.task, pairs, queried if spec.task == 'mqar' else 0):
    raise ValueError(f'{spec.task}: a row of {spec.length} tokens cannot hold {pairs} pairs')
  words, scored = GENERATORS[spec.task](rng, spec, pairs, queried)
  assert len(words) == spec.length, (spec, len(words))
  return words, scored


def split_examples(spec: SyntheticSpec, split: str) -> list[tuple[str, str]]:
  """The examples of a split as (words, scored indices) texts, deterministic in spec and split."""
  rng = random.Random(f'{spec.task}/{split}')
  out = []
  for _ in range(SPLITS[split]):
    words, scored = sample_example(rng, spec)
    out.append((' '.join(words), ' '.join(map(str, scored))))
  return out


def grid_examples(spec: SyntheticSpec, pairs: int, count: int) -> list[tuple[list[str], list[int]]]:
  """`count` mqar evaluation examples with `pairs` pairs (and min(queries, pairs) queries), the
  same for every run of the same setting (seeded apart from the splits)."""
  rng = random.Random(f'{spec.task}/grid/{pairs}')
  return [sample_example(rng, spec, pairs) for _ in range(count)]


def row(ids, scored, length: int) -> dict[str, np.ndarray]:
  """The decoder-only features of one example: `<bos> ids` as inputs and targets shifted by one,
  weights 1 on the targets that are scored words; segment_ids 1, positions 0..L-1.

  Args:
    ids: the token ids of the example's words after `<bos>` (length + 1 - 1 of them).
    scored: indices into `ids` of the scored words.
    length: the row's length L.
  """
  tokens = np.concatenate([[tokenizer_lib.BOS], ids]).astype(np.int32)
  if len(tokens) != length + 1:
    raise ValueError(f'synthetic: an example of {len(tokens) - 1} input tokens in a row of '
                     f'{length}')
  weights = np.zeros(length, np.float32)
  weights[np.asarray(scored, np.int64)] = 1.0  # word i of ids is the target of input position i
  return {'inputs': tokens[:-1], 'targets': tokens[1:], 'weights': weights,
          'segment_ids': np.ones(length, np.int32), 'positions': np.arange(length, dtype=np.int32)}


def key_query_distance(words: list[str], index: int) -> int:
  """mqar: tokens from the key's place in the context to its query (the word before `index`)."""
  key = words[index - 1]
  return index - 1 - words.index(key)


# --- The TFDS builder -------------------------------------------------------------------------

class SyntheticConfig(tfds.core.BuilderConfig):
  """One setting of a task: a dataset folder of its own."""

  def __init__(self, spec: SyntheticSpec):
    super().__init__(name=spec.name, version=tfds.core.Version('1.0.0'),
                     description=f'The generated {spec.task} task.')
    self.spec = spec


class SyntheticTasks(tfds.core.GeneratorBasedBuilder):
  """The synthetic tasks' splits; one builder config per task and setting."""

  VERSION = tfds.core.Version('1.0.0')

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description='Recall, induction, selective copying and memorisation rows.',
        features=tfds.features.FeaturesDict({'words': tfds.features.Text(),
                                             'scored': tfds.features.Text()}),
        disable_shuffling=True)  # generation order (the pipeline shuffles)

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    return {split: self._generate_examples(split) for split in SPLITS}

  def _generate_examples(self, split):
    for i, (words, scored) in enumerate(split_examples(self.builder_config.spec, split)):
      yield i, {'words': words, 'scored': scored}


def dataset_dir(spec: SyntheticSpec) -> str:
  """Where TFDS writes the spec's dataset: data_dir/synthetic_tasks/<config name>/<version>."""
  return os.path.join(spec.data_dir, 'synthetic_tasks', spec.name, str(SyntheticTasks.VERSION))


def prepare(spec) -> str:
  """Generates the spec's dataset and tokenizer under spec.data_dir unless already there; returns
  the dataset directory (`data.generated.prepare`)."""
  builder = lambda: SyntheticTasks(config=SyntheticConfig(spec), data_dir=spec.data_dir)
  return generated.prepare(spec.data_dir, f'.synthetic_{spec.name}.lock', dataset_dir(spec),
                           builder, vocabulary(spec))


def load_tokenizer(spec) -> tokenizer_lib.Tokenizer:
  """Prepares the dataset if needed and loads its tokenizer."""
  return generated.load_tokenizer(prepare(spec))


def read_split(spec, split: str) -> list[tuple[str, str]]:
  """A prepared split in generation order, as (words, scored indices) texts."""
  return [(r['words'].decode(), r['scored'].decode())
          for r in generated.read_records(prepare(spec), split)]


def encode(tokenizer, words: str, scored: str) -> dict[str, np.ndarray]:
  """An example's texts as {'ids', 'scored'} int32 arrays."""
  return {'ids': np.asarray(tokenizer.encode(words), np.int32),
          'scored': np.asarray([int(i) for i in scored.split()], np.int32)}
