"""Toy translation TFDS builder: a synthetic SVO -> SOV language pair generated from a seed."""

import dataclasses
import fcntl
import os
import random

import tensorflow_datasets as tfds

from data import preparation
from data import tokenizer as tokenizer_lib

TOKENIZER_FILE = 'tokenizer.json'

# Source (English-like: SVO, determiner + adjectives before the noun, prepositions, subject
# relative clauses "that ...") -> target (SOV, adjectives after the noun in mirrored order,
# determiner last, plural marker, object-case marker, postpositions). Every source word has exactly
# one rendering, and every construction one target order, so the translation is a function of the
# source sentence.
NOUNS = {
    'cat': 'neko', 'dog': 'inu', 'bird': 'tori', 'snake': 'hebi', 'horse': 'uma', 'cow': 'ushi',
    'goat': 'yagi', 'ant': 'ari', 'bear': 'kuma', 'frog': 'kaeru', 'rabbit': 'usagi',
    'duck': 'ahiru', 'boy': 'shonen', 'girl': 'shojo', 'king': 'oosama', 'queen': 'joou',
    'teacher': 'sensei', 'farmer': 'noufu', 'doctor': 'isha', 'friend': 'tomo', 'house': 'ie',
    'tree': 'jumoku', 'river': 'kawa', 'garden': 'niwa', 'table': 'tsukue', 'car': 'kuruma',
    'hill': 'oka', 'boat': 'fune',
}
TRANSITIVE_VERBS = {
    'saw': 'mita', 'chased': 'otta', 'liked': 'suita', 'found': 'mitsuketa', 'followed': 'tsuita',
    'helped': 'tasuketa', 'pushed': 'oshita', 'watched': 'nagameta', 'caught': 'tsukamaeta',
    'visited': 'otozureta', 'called': 'yonda', 'knew': 'shitta',
}
INTRANSITIVE_VERBS = {
    'slept': 'neta', 'ran': 'hashitta', 'jumped': 'tonda', 'sang': 'utatta', 'laughed': 'waratta',
    'fell': 'ochita',
}
ADJECTIVES = {
    'big': 'ookii', 'small': 'chiisai', 'red': 'akai', 'blue': 'aoi', 'old': 'furui',
    'young': 'wakai', 'happy': 'ureshii', 'sad': 'kanashii', 'fast': 'hayai', 'quiet': 'shizuka',
}
PREPOSITIONS = {'in': 'naka', 'on': 'ue', 'near': 'chikaku', 'under': 'shita', 'behind': 'ushiro'}
SINGULAR_DETERMINERS = {'the': 'le', 'a': 'un'}
PLURAL_DETERMINERS = {'the': 'le', 'some': 'su'}
RELATIVIZER = ('that', 'ki')  # source word, target word (the target clause follows the noun)
PLURAL_MARKER = 'ra'  # target token after a plural noun; the source marks plural as noun + 's'
OBJECT_CASE = 'o'  # target token closing an object noun phrase


def vocabulary() -> list[str]:
  """Returns every source and target word of the grammar, sorted (the tokenizer's vocabulary)."""
  determiners = {**SINGULAR_DETERMINERS, **PLURAL_DETERMINERS}
  tables = [NOUNS, TRANSITIVE_VERBS, INTRANSITIVE_VERBS, ADJECTIVES, PREPOSITIONS, determiners]
  source = [w for table in tables for w in table] + [n + 's' for n in NOUNS] + [RELATIVIZER[0]]
  target = [w for table in tables for w in table.values()]
  target += [RELATIVIZER[1], PLURAL_MARKER, OBJECT_CASE]
  # Distinct target words keep the mapping invertible; disjoint vocabularies make every token's
  # language unambiguous (the loss mask and the attention maps rely on it).
  assert len(set(target)) == len(target), 'target words must be distinct'
  assert not set(source) & set(target), f'shared words: {set(source) & set(target)}'
  return sorted(set(source) | set(target))


@dataclasses.dataclass(frozen=True)
class SplitSpec:
  """How one split is sampled.

  Attributes:
    num_examples: number of (unique) sentence pairs.
    min_words: shortest source sentence, in words.
    max_words: longest source sentence, in words.
    p_adjective: probability of each further adjective before a noun (geometric, capped).
    max_adjectives: most adjectives on one noun.
    p_pp: probability that a noun gets a prepositional phrase.
    p_relative: probability that a noun gets a relative clause.
    max_depth: most nested relative clauses.
    p_transitive: probability that a clause has an object.
  """
  num_examples: int
  min_words: int
  max_words: int
  p_adjective: float = 0.3
  max_adjectives: int = 2
  p_pp: float = 0.2
  p_relative: float = 0.2
  max_depth: int = 2
  p_transitive: float = 0.75


class ToyTranslationConfig(tfds.core.BuilderConfig):
  """A task: the seed and the split specs of the generated corpus."""

  def __init__(self, *, seed: int, splits: dict[str, SplitSpec], **kwargs):
    super().__init__(version=tfds.core.Version('1.0.0'), **kwargs)
    self.seed = seed
    self.splits = splits


_IN_LENGTH = dict(min_words=3, max_words=12)
# Longer sentences come from more modifiers and deeper relative clauses, as in extrapolation tests.
_LONG = dict(p_adjective=0.5, max_adjectives=3, p_pp=0.4, p_relative=0.45, max_depth=3,
             p_transitive=0.9)
_XLONG = dict(p_adjective=0.6, max_adjectives=3, p_pp=0.5, p_relative=0.6, max_depth=4,
              p_transitive=1.0)

# Eval splits come first: a sentence seen in an earlier split is skipped by the later ones, so the
# eval splits are plain samples of their distribution and train avoids all of them.
TASKS = {
    'base': ToyTranslationConfig(
        name='base', description='SVO -> SOV with adjectives, PPs and relative clauses.', seed=0,
        splits={
            'test': SplitSpec(1000, **_IN_LENGTH),
            'validation': SplitSpec(1000, **_IN_LENGTH),
            'test_long': SplitSpec(1000, min_words=13, max_words=25, **_LONG),
            'test_xlong': SplitSpec(1000, min_words=26, max_words=40, **_XLONG),
            'train': SplitSpec(20000, **_IN_LENGTH),
        }),
}


def _noun_phrase(rng, spec, depth, simple=False):
  """Samples a noun phrase; returns (source words, target core, target relative clause).

  The target core (PP, noun, plural, adjectives, determiner) and the relative clause are returned
  apart because an object's case marker goes between them.
  """
  plural = rng.random() < 0.3
  determiners = PLURAL_DETERMINERS if plural else SINGULAR_DETERMINERS
  det = rng.choice(sorted(determiners))
  num_adjs = 0
  while num_adjs < spec.max_adjectives and rng.random() < spec.p_adjective:
    num_adjs += 1
  adjs = rng.sample(sorted(ADJECTIVES), num_adjs)  # Distinct: no "the red red cat".
  noun = rng.choice(sorted(NOUNS))
  src = [det] + adjs + [noun + 's' if plural else noun]
  # Mirror image of the source order around the noun: noun, plural, adjectives reversed, det.
  tgt = ([NOUNS[noun]] + ([PLURAL_MARKER] if plural else [])
         + [ADJECTIVES[a] for a in reversed(adjs)] + [determiners[det]])
  if simple:
    return src, tgt, []
  pp_src, pp_tgt, rel_src, rel_tgt = [], [], [], []
  if rng.random() < spec.p_pp:
    # The PP object is a simple noun phrase, so a following relative clause can only attach to
    # the head noun: this keeps the source unambiguous.
    prep = rng.choice(sorted(PREPOSITIONS))
    obj_src, obj_tgt, _ = _noun_phrase(rng, spec, depth, simple=True)
    pp_src, pp_tgt = [prep] + obj_src, obj_tgt + [PREPOSITIONS[prep]]
  if depth < spec.max_depth and rng.random() < spec.p_relative:
    verb_src, verb_tgt = _predicate(rng, spec, depth + 1)
    rel_src, rel_tgt = [RELATIVIZER[0]] + verb_src, [RELATIVIZER[1]] + verb_tgt
  # Target: the postpositional phrase precedes the noun, the relative clause follows it.
  return src + pp_src + rel_src, pp_tgt + tgt, rel_tgt


def _predicate(rng, spec, depth):
  """Samples a verb phrase; returns (source words, target words) in SVO / SOV order."""
  if rng.random() < spec.p_transitive:
    verb = rng.choice(sorted(TRANSITIVE_VERBS))
    obj_src, obj_core, obj_rel = _noun_phrase(rng, spec, depth)
    # The case marker closes the object's core phrase, before its relative clause.
    return [verb] + obj_src, obj_core + [OBJECT_CASE] + obj_rel + [TRANSITIVE_VERBS[verb]]
  verb = rng.choice(sorted(INTRANSITIVE_VERBS))
  return [verb], [INTRANSITIVE_VERBS[verb]]


def sample_pair(rng: random.Random, spec: SplitSpec) -> tuple[str, str]:
  """Samples one sentence pair (any length).

  Args:
    rng: the random generator, advanced in place.
    spec: the split's sampling parameters.

  Returns:
    (source, target) as space-separated words.
  """
  subj_src, subj_core, subj_rel = _noun_phrase(rng, spec, depth=0)
  pred_src, pred_tgt = _predicate(rng, spec, depth=0)
  return ' '.join(subj_src + pred_src), ' '.join(subj_core + subj_rel + pred_tgt)


def generate_corpus(config: ToyTranslationConfig) -> dict[str, list[tuple[str, str]]]:
  """Generates every split of a task: deterministic in the config, no sentence in two splits.

  Args:
    config: the task.

  Returns:
    split name -> list of (source, target) pairs.
  """
  seen, corpus = set(), {}
  for split, spec in config.splits.items():
    rng = random.Random(f'{config.seed}/{split}')  # str seeds are hashed stably (sha512)
    pairs = []
    while len(pairs) < spec.num_examples:
      source, target = sample_pair(rng, spec)
      if spec.min_words <= len(source.split()) <= spec.max_words and source not in seen:
        seen.add(source)
        pairs.append((source, target))
    corpus[split] = pairs
  return corpus


class ToyTranslation(tfds.core.GeneratorBasedBuilder):
  """The toy translation corpus; one builder config per task."""

  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIGS = list(TASKS.values())
  DEFAULT_CONFIG_NAME = 'base'

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly: dataset_info_from_configs would look for metadata files in data/.
    return tfds.core.DatasetInfo(
        builder=self,
        description='Synthetic SVO -> SOV translation generated from a seeded grammar.',
        features=tfds.features.FeaturesDict({
            'source': tfds.features.Text(),
            'target': tfds.features.Text(),
        }),
        supervised_keys=('source', 'target'),
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Nothing to download.
    corpus = generate_corpus(self.builder_config)  # All splits at once, to deduplicate across.
    return {split: self._generate_examples(pairs) for split, pairs in corpus.items()}

  def _generate_examples(self, pairs):
    for i, (source, target) in enumerate(pairs):
      yield i, {'source': source, 'target': target}


def prepare(data_dir: str, task: str = 'base') -> str:
  """Generates the task's dataset and tokenizer under data_dir unless already there.

  Idempotent: TFDS skips a prepared dataset and the tokenizer is written only when missing.
  Concurrent first calls (several local processes, parallel test workers) are serialised by a
  file lock next to the data; the tokenizer file, written last, marks a complete dataset.

  Args:
    data_dir: root of the TFDS data (the dataset lands in data_dir/toy_translation/<task>/<ver>).
    task: builder config name.

  Returns:
    The prepared dataset directory, which also holds tokenizer.json.
  """
  if task not in TASKS:
    raise ValueError(f'Unknown task {task!r}; valid values: {sorted(TASKS)}')
  data_dir = os.path.abspath(os.path.expanduser(data_dir))
  builder = ToyTranslation(config=task, data_dir=data_dir)
  dataset_dir = os.fspath(builder.data_dir)
  tokenizer_path = os.path.join(dataset_dir, TOKENIZER_FILE)
  if os.path.exists(tokenizer_path):
    return dataset_dir
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, f'.toy_translation_{task}.lock'), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not os.path.exists(tokenizer_path):  # another process may have finished meanwhile
      tfds.disable_progress_bar()  # The bars would flood the training logs for a 2-second job.
      with preparation.preparing(dataset_dir, 'the dataset'):
        builder.download_and_prepare(file_format='array_record')
        tokenizer_lib.Tokenizer.from_words(vocabulary()).save(tokenizer_path)
  return dataset_dir


def load_tokenizer(data_dir: str, task: str = 'base') -> tokenizer_lib.Tokenizer:
  """Prepares the task if needed and loads its tokenizer."""
  return tokenizer_lib.Tokenizer.load(os.path.join(prepare(data_dir, task), TOKENIZER_FILE))
