"""The synthetic tasks (data/synthetic.py): each generator puts the answer where a model that has
the task's mechanism can read it and nowhere else, deterministically; the rows weight the scored
tokens alone; bad knobs are one line each; the mqar recall report is right for a model that looks
the keys up and at chance for one that does not."""

import random

import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from configs import induction as induction_config
from configs import memorize as memorize_config
from configs import mqar as mqar_config
from configs import selective_copy as selective_copy_config
from data import pipeline
from data import synthetic
from data import tokenizer as tokenizer_lib
from layers import options
from tools import accounting
from training import recall
from training import validation

CONFIGS = {'mqar': mqar_config, 'induction': induction_config,
           'selective_copy': selective_copy_config, 'memorize': memorize_config}


def _spec(task, length=48, pairs=6, key_vocab=32, value_vocab=24, queries=0):
  return synthetic.SyntheticSpec("/unused", task, length, pairs, key_vocab, value_vocab, queries)


def _config(task, **knobs):
  config = validation.resolve(CONFIGS[task].get_config('quick'))
  config.data.synthetic.update(knobs)
  return config


# --- The generators ------------------------------------------------------------------------------

@pytest.mark.parametrize('queries', [0, 3])
def test_mqar_asks_keys_of_the_context_and_scores_their_values(queries):
  spec = _spec('mqar', queries=queries)
  for seed in range(20):
    words, scored = synthetic.sample_example(random.Random(seed), spec)
    assert len(words) == spec.length  # <bos> + words = L inputs + the last target
    context = dict(zip(words[0:12:2], words[1:12:2]))  # 6 pairs: k v k v ...
    assert len(context) == 6 and all(k.startswith('k') for k in context)  # distinct keys
    assert len(scored) == spec.queried and len(set(words[i - 1] for i in scored)) == len(scored)
    for i in scored:
      assert words[i - 1] in context and words[i] == context[words[i - 1]]  # the asked value
      assert synthetic.key_query_distance(words, i) == i - 1 - words.index(words[i - 1]) >= 2
    # Keys appear only in the context and as queries: the lookup is unambiguous.
    keys_after = [w for w in words[12:] if w.startswith('k')]
    assert len(keys_after) == len(scored)


def test_induction_repeats_a_segment_whose_tokens_occur_once_before():
  spec = _spec('induction', length=40, pairs=5, value_vocab=12)
  for seed in range(20):
    words, scored = synthetic.sample_example(random.Random(seed), spec)
    assert len(words) == 40 and len(scored) == 4
    start = scored[0] - 1  # the repeat's first token, not scored
    segment = words[start:start + 5]
    assert len(set(segment)) == 5
    for i in scored:  # the token before occurred exactly once earlier; the answer followed it
      earlier = words[:i - 1]
      assert earlier.count(words[i - 1]) == 1
      assert words[earlier.index(words[i - 1]) + 1] == words[i]


def test_selective_copy_copies_the_scattered_tokens_in_order():
  spec = _spec('selective_copy', length=30, pairs=5, value_vocab=8)
  words, scored = synthetic.sample_example(random.Random(3), spec)
  at = words.index(synthetic.COPY)
  data = [w for w in words[:at] if w != synthetic.BLANK]
  assert len(data) == 5 and [words[i] for i in scored] == data and scored[0] == at + 1


def test_memorize_uses_one_map_for_every_row_and_split():
  """Keys are two part tokens (7 x 7 >= 40: parts k0..k6), distinct in a row, and every split
  reads the same map."""
  spec = _spec('memorize', length=20, pairs=6, key_vocab=40, value_vocab=10)
  table = synthetic.memorize_map(40, 10)
  assert synthetic.key_parts(40) == 7 and synthetic.key_parts(49) == 7
  assert synthetic.key_parts(50) == 8
  seen = {}
  for split in ('train', 'test'):
    for words, scored in synthetic.split_examples(spec, split)[:200]:
      words, scored = words.split(), [int(i) for i in scored.split()]
      keys = [7 * int(words[i - 2][1:]) + int(words[i - 1][1:]) for i in scored]
      assert len(set(keys)) == 6 and max(keys) < 40  # distinct keys a row: nothing to copy
      for i, k in zip(scored, keys):
        assert words[i] == synthetic.value_word(table[k])
        seen.setdefault(k, set()).add(words[i])
  assert all(len(v) == 1 for v in seen.values()) and len(seen) == 40


def test_generation_is_deterministic_and_splits_differ():
  spec = _spec('mqar')
  first = synthetic.split_examples(spec, 'validation')
  assert first == synthetic.split_examples(spec, 'validation')
  assert first != synthetic.split_examples(spec, 'test')
  assert len(set(first)) == len(first) == synthetic.SPLITS['validation']
  assert synthetic.grid_examples(spec, 3, 4) == synthetic.grid_examples(spec, 3, 4)


def test_a_row_weights_the_scored_tokens_alone():
  spec = _spec('mqar', length=20, pairs=3, queries=2)
  tok = tokenizer_lib.Tokenizer.from_words(synthetic.vocabulary(spec))
  words, scored = synthetic.sample_example(random.Random(0), spec)
  row = synthetic.row(np.asarray(tok.encode(' '.join(words))), scored, 20)
  assert row['inputs'][0] == tokenizer_lib.BOS and row['inputs'].shape == (20,)
  assert list(np.flatnonzero(row['weights'])) == scored
  assert tok.decode(row['targets'][row['weights'] > 0]) == ' '.join(words[i] for i in scored)
  np.testing.assert_array_equal(row['targets'][:-1], row['inputs'][1:])
  with pytest.raises(ValueError, match='an example of 20 input tokens in a row of 19'):
    synthetic.row(np.asarray(tok.encode(' '.join(words))), scored, 19)


@pytest.mark.parametrize('task', synthetic.TASKS)
def test_pipeline_batches_of_every_task(tmp_path, task):
  config = _config(task)
  config.data.data_dir = str(tmp_path)
  spec = synthetic.spec_from_config(config.data)
  batch = next(pipeline.make_iterator(config.data, 'train', 8, seed=1))
  assert batch['inputs'].shape == (8, spec.length) and batch['weights'].dtype == np.float32
  per_row = {'mqar': spec.queried, 'induction': spec.pairs - 1, 'selective_copy': spec.pairs,
             'memorize': spec.pairs}[task]
  np.testing.assert_array_equal(batch['weights'].sum(1), per_row)
  assert not pipeline.has_pairs(config.data)
  assert pipeline.split_names(config.data) == ['test', 'validation', 'train']


# --- Configs and bad inputs ---------------------------------------------------------------------

def test_the_config_files_validate_and_the_defaults_agree():
  for module in CONFIGS.values():
    for arg in (None, 'quick'):
      validation.validate(validation.resolve(module.get_config(arg)))
  assert dict(default.get_config().data.synthetic) == synthetic.DEFAULTS


BAD_CONFIGS = [
    ('mqar', {'pairs': 20}, 'data.max_length=32 cannot hold a mqar row with 20 pairs and 20 '
                            'queries .* valid: data.max_length >= 80'),
    ('mqar', {'pairs': 8, 'key_vocab': 4}, 'data.synthetic.key_vocab=4 is too small for 8 '
                                           'distinct keys a row .* valid: key_vocab >= 8'),
    ('mqar', {'queries': 5}, r'data.synthetic.queries=5 asks more keys than the 4 pairs of a row '
                             r'\(data.synthetic.pairs\); valid: 0 \(every key\) to 4'),
    ('mqar', {'value_vocab': 1}, 'data.synthetic.value_vocab=1 is too small .* valid: '
                                 'value_vocab >= 2'),
    ('mqar', {'pairs': 0}, 'data.synthetic.pairs=0 must be a positive integer'),
    ('induction', {'value_vocab': 4}, "data.synthetic.value_vocab=4 is too small for "
                                      "data.task='induction' with data.synthetic.pairs=4; valid: "
                                      'value_vocab >= 5'),
    ('induction', {'queries': 2}, "data.synthetic.queries=2 is not read by data.task='induction' "
                                  r'\(only by mqar\); valid here: 0'),
    ('selective_copy', {'pairs': 16}, 'data.max_length=32 cannot hold a selective_copy row .* '
                                      'valid: data.max_length >= 33'),
    ('memorize', {'key_vocab': 3}, 'data.synthetic.key_vocab=3 is too small for 4 distinct keys'),
    ('memorize', {'pairs': 6}, 'data.max_length=16 cannot hold a memorize row with 6 pairs .* '
                               'valid: data.max_length >= 18'),
]


@pytest.mark.parametrize('task,knobs,message', BAD_CONFIGS, ids=[f'{t}-{k}' for t, k, _ in
                                                                 BAD_CONFIGS])
def test_bad_knobs_are_one_line(task, knobs, message):
  with pytest.raises(options.ConfigError, match=message) as e:
    validation.validate(_config(task, **knobs))
  assert '\n' not in str(e.value)


def test_knobs_of_another_task_and_a_wrong_arch_are_refused():
  config = validation.resolve(default.get_config('quick'))
  config.data.synthetic.pairs = 8
  with pytest.raises(options.ConfigError, match=r"data.synthetic.pairs=8 is read only by "
                     r"data.task in mqar, induction, selective_copy, memorize "
                     r"\(data.task='base'\)"):
    validation.validate(config)
  config = _config('mqar')
  config.model.arch = 'encoder_decoder'
  with pytest.raises(options.ConfigError, match="data.task='mqar' is a decoder_only task"):
    validation.validate(config)
  config = _config('mqar')
  config.data.packing = 'stream'
  with pytest.raises(options.ConfigError, match="data.packing='stream' is not valid"):
    validation.validate(config)


# --- The recall report --------------------------------------------------------------------------

def _looker(tok, right):
  """A model whose logits at a key put the value that followed that key's first occurrence first
  (right) or the unknown token first (never right)."""
  ids = jnp.arange(tok.vocab_size)

  def model(batch):
    inputs = batch['inputs']  # [B, T]
    same = inputs[:, :, None] == inputs[:, None, :]  # [B, T, T]
    first = jnp.argmax(same, axis=2)  # the first occurrence of each position's token
    answer = jnp.take_along_axis(inputs, jnp.minimum(first + 1, inputs.shape[1] - 1), axis=1)
    scores = jnp.where(ids == answer[..., None], 2.0, 0.0)  # [B, T, V]
    if not right:
      scores = scores + jnp.where(ids == tokenizer_lib.UNK, 3.0, 0.0)
    return scores
  return model


def test_the_recall_report_by_pairs_and_distance(tmp_path):
  config = _config('mqar', pairs=4, key_vocab=16, value_vocab=16)
  config.data.max_length = 40
  config.data.data_dir = str(tmp_path)
  tok = pipeline.get_tokenizer(config.data)
  assert accounting.task_vocab_size(config.data) == tok.vocab_size  # known without the data
  spec = synthetic.spec_from_config(config.data)
  assert recall.pair_levels(spec) == [1, 2, 4, 8]  # 8 pairs and 8 queries fill 32 of 40
  good = recall.recall(config, _looker(tok, True), tok, examples=10)
  assert good['by_pairs'] == {'1': 1.0, '2': 1.0, '4': 1.0, '8': 1.0}
  assert set(good['by_distance'].values()) == {1.0}
  assert list(good['by_distance'])[0] == '2-3'  # a query right after the context
  bad = recall.recall(config, _looker(tok, False), tok, examples=10)
  assert set(bad['by_pairs'].values()) == {0.0}
  assert recall.distance_bucket(2) == '2-3' and recall.distance_bucket(9) == '8-15'
  assert recall.summary_lines(good)[0].startswith(
      'recall by key-value pairs in the context: 1 pair 100.0%  2 pairs 100.0%')
  assert recall.summary_lines(bad)[1].split()[-1] == '0.0%'
