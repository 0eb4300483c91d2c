"""The passkey retrieval task (data/passkey.py): the generator puts the key where it is asked and
the value where it can be read back, deterministically; the rows weight the value alone; the bad
inputs are one line each; the retrieval report has one accuracy per length and depth, right for a
model that reads the value and wrong for one that does not."""

import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from configs import passkey as passkey_config
from data import passkey
from data import pipeline
from data import tokenizer as tokenizer_lib
from layers import options
from tools.plots import run_pictures as plots
from training import eval_checks
from training import retrieval
from training import validation
from training import validation_passkey

L = 24  # short rows: the dataset of the pipeline test is generated in well under a second


def _config(**data):
  config = validation.resolve(passkey_config.get_config('quick'))
  config.data.update(data)
  return config


@pytest.fixture(scope='module')
def tok():
  return tokenizer_lib.Tokenizer.from_words(passkey.vocabulary())  # as prepare saves it


# --- The generator ------------------------------------------------------------------------------

@pytest.mark.parametrize('value_tokens', [1, 3])
def test_the_key_sits_at_the_requested_depth_and_the_value_is_recoverable(value_tokens):
  length = 40
  filler = length - passkey.overhead(value_tokens)
  for depth in (0.0, 0.25, 0.5, 0.9, 1.0):
    prompt, value = passkey.sample_example(random.Random(7), length, depth, 10, value_tokens)
    at = prompt.index(passkey.KEY_MARKER)
    assert at == round(depth * filler)  # the filler words before the key
    assert prompt.count(passkey.KEY_MARKER) == prompt.count(passkey.QUERY_MARKER) == 1
    key = prompt[at + 1]
    assert prompt[at + 2:at + 2 + value_tokens] == value  # read back after <key> K
    assert prompt[-2:] == [passkey.QUERY_MARKER, key]  # the query closes the prompt
    assert len(prompt) + value_tokens == length  # <bos> prompt value[:-1]
    assert set(value) <= set(passkey.words()[:10])  # drawn from the value vocabulary


def test_generation_is_deterministic():
  spec = passkey.PasskeySpec('/unused', L, 16, 1, (0.2, 0.6))
  assert (passkey.retrieval_examples(spec, 48, 0.3, 5)
          == passkey.retrieval_examples(spec, 48, 0.3, 5))
  assert (passkey.retrieval_examples(spec, 48, 0.3, 5)
          != passkey.retrieval_examples(spec, 48, 0.4, 5))
  first = passkey.split_examples(spec, 'validation')
  assert first == passkey.split_examples(spec, 'validation')
  assert first != passkey.split_examples(spec, 'test')
  assert len(first) == passkey.SPLITS['validation'] and len(set(first)) > 990
  filler = L - passkey.overhead(1)
  depths = [p.split().index(passkey.KEY_MARKER) / filler for p, _ in first]
  assert 0.2 - 0.5 / filler <= min(depths) and max(depths) <= 0.6 + 0.5 / filler  # the range
  assert max(depths) - min(depths) > 0.35  # ... and spread over it


def test_a_row_weights_the_value_alone(tok):
  prompt, value = passkey.sample_example(random.Random(0), L, 0.5, 16, 2)
  row = passkey.row(tok.encode(' '.join(prompt)), tok.encode(' '.join(value)), L + 3)
  n = L  # real tokens; three of padding
  assert row['inputs'][0] == tokenizer_lib.BOS and row['inputs'][n - 1] != 0
  assert not row['inputs'][n:].any() and not row['segment_ids'][n:].any()
  assert list(np.flatnonzero(row['weights'])) == [n - 2, n - 1]
  assert tok.decode(row['targets'][row['weights'] > 0]) == ' '.join(value)
  np.testing.assert_array_equal(row['targets'][:n - 1], row['inputs'][1:n])
  with pytest.raises(ValueError, match='does not fit a row of 10'):
    passkey.row(tok.encode(' '.join(prompt)), tok.encode(' '.join(value)), 10)


def test_pipeline_batches_predict_the_value_after_the_key(tmp_path, tok):
  config = _config(data_dir=str(tmp_path), max_length=L, passkey_values=8)
  assert pipeline.split_names(config.data) == ['test', 'validation', 'train']
  assert pipeline.get_tokenizer(config.data).tokens == tok.tokens
  batch = next(pipeline.make_iterator(config.data, 'validation', 16, seed=1))
  assert batch['inputs'].shape == (16, L) and batch['weights'].sum() == 16
  key_id = tok.encode(passkey.KEY_MARKER)[0]
  for inputs, targets, weights in zip(batch['inputs'], batch['targets'], batch['weights']):
    at = list(inputs).index(key_id)
    assert targets[weights > 0][0] == inputs[at + 2]  # the value after <key> K
    assert weights[-1] == 1 and inputs[-2] == tok.encode(passkey.QUERY_MARKER)[0]
  assert not pipeline.has_pairs(config.data)
  with pytest.raises(ValueError, match="data.task='passkey' holds prompts"):
    pipeline.load_examples(config.data, 'test')


# --- Configs and bad inputs ---------------------------------------------------------------------

def test_the_config_files_validate_and_the_defaults_agree():
  for arg in (None, 'quick'):
    config = validation.resolve(passkey_config.get_config(arg))
    validation.validate(config)
    assert config.data.task == 'passkey' and config.model.position == 'rope'
  data = default.get_config().data
  assert {k: (tuple(v) if isinstance(v, (list, tuple)) else v)
          for k, v in data.items() if k.startswith('passkey_')} == passkey.DEFAULTS


BAD_CONFIGS = [
    ({'passkey_depths': (0.0, 1.5)}, r'data.passkey_depths=\(0.0, 1.5\): depth 1.5 is outside '
                                     r'\[0, 1\]'),
    ({'passkey_depths': (-0.1, 0.5)}, r'depth -0.1 is outside \[0, 1\]'),
    ({'passkey_depths': (0.8, 0.2)}, 'low > high'),
    ({'passkey_depths': (0.5,)}, 'must be two numbers'),
    ({'passkey_values': 500}, "data.passkey_values=500 must be an integer from 2 to 160: the "
                              "values are words of the tokenizer's vocabulary"),
    ({'passkey_values': 1}, 'passkey_values=1 must be an integer from 2'),
    ({'passkey_value_tokens': 0}, 'passkey_value_tokens=0 must be a positive integer'),
    ({'max_length': 8, 'passkey_value_tokens': 3}, 'data.max_length=8 cannot hold a passkey '
                                                    'example .* valid: data.max_length >= 11'),
    ({'packing': 'stream'}, "data.packing='stream' is not valid for data.task='passkey'"),
    ({'task': 'base', 'passkey_values': 64}, "data.passkey_values=64 is read only by "
                                             "data.task='passkey'"),
]


@pytest.mark.parametrize('data,message', BAD_CONFIGS, ids=[str(d) for d, _ in BAD_CONFIGS])
def test_bad_passkey_fields_are_one_line(data, message):
  with pytest.raises(options.ConfigError, match=message) as e:
    validation.validate(_config(**data))
  assert '\n' not in str(e.value)


def test_an_arch_or_loss_the_task_cannot_use_is_refused():
  config = _config()
  config.model.arch = 'encoder_decoder'
  with pytest.raises(options.ConfigError, match="is a decoder_only task"):
    validation.validate(config)
  config = _config()
  config.train.loss_on = 'all'
  with pytest.raises(options.ConfigError, match="train.loss_on='all' is not valid"):
    validation.validate(config)


def _fake_run(path, **model):
  """A workdir with only a passkey config.json: eval.py's checks read nothing else."""
  config = _config(max_length=32)
  config.model.update(model)
  os.makedirs(path, exist_ok=True)
  (path / 'config.json').write_text(config.to_json_best_effort())


def test_eval_lengths_the_model_cannot_take_are_refused(tmp_path):
  run = dict(split=['test'], translate=[], stream_split='test', rope_scaling=None)
  _fake_run(tmp_path / 'learned', position='learned')
  learned = str(tmp_path / 'learned')
  eval_checks.check_eval_run(learned, lengths=[1.0, 0.5], **run)
  with pytest.raises(options.ConfigError, match=r'the retrieval report \(default '
                     r'--lengths=1,2,4,8\): 2 x data.max_length=32 = 64 positions; the run\'s '
                     'position=learned table has 32 rows; valid: multiples <= 1') as e:
    eval_checks.check_eval_run(learned, lengths=[], **run)
  assert '\n' not in str(e.value)
  _fake_run(tmp_path / 'rope', position='rope')
  rope = str(tmp_path / 'rope')
  eval_checks.check_eval_run(rope, lengths=[], **run)  # RoPE takes any length
  with pytest.raises(options.ConfigError, match='= 4 tokens, under the 7 a passkey example '
                     'needs; valid: multiples >= 0.21875'):
    eval_checks.check_eval_run(rope, lengths=[0.125], **run)
  with pytest.raises(options.ConfigError, match="--translate=test decodes target sentences; "
                     "data.task='passkey' holds retrieval prompts"):
    eval_checks.check_eval_run(rope, lengths=[], **{**run, 'translate': ['test']})
  flags = dict(split=['test'], max_examples=0, lengths=[], modes=['sliding'], stride=0.5,
               num_beams=1, length_penalty=0.6, temperature=1.0, top_k=0, top_p=1.0,
               plot_attention=0, rope_scaling=None)
  with pytest.raises(options.ConfigError, match='--retrieval_examples=0 must be a positive'):
    eval_checks.check_eval_flags(**flags, retrieval_examples=0)


# --- The retrieval report -----------------------------------------------------------------------

def _reader(tok, right):
  """A model whose logits at every position put the token two after `<key>` first (or second):
  a perfect (or a never-right) passkey reader."""
  key_id = tok.encode(passkey.KEY_MARKER)[0]

  def model(batch):
    inputs = batch['inputs']  # [B, T]
    at = jnp.argmax(inputs == key_id, axis=1)
    value = jnp.take_along_axis(inputs, at[:, None] + 2, axis=1)  # [B, 1]
    scores = jnp.where(jnp.arange(tok.vocab_size) == value[..., None], 2.0, 0.0)  # [B, 1, V]
    if not right:
      scores = scores + jnp.where(jnp.arange(tok.vocab_size) == tokenizer_lib.UNK, 3.0, 0.0)
    return jnp.broadcast_to(scores, inputs.shape + (tok.vocab_size,))
  return model


def test_the_report_has_one_accuracy_per_length_and_depth(tok, tmp_path):
  config = _config(max_length=16)
  depths = (0.0, 0.5, 1.0)
  report = retrieval.retrieval(config, _reader(tok, True), tok, [16, 32], depths, examples=3)
  assert report == {'16': {'0.0': 1.0, '0.5': 1.0, '1.0': 1.0},
                    '32': {'0.0': 1.0, '0.5': 1.0, '1.0': 1.0}}
  wrong = retrieval.retrieval(config, _reader(tok, False), tok, [16], depths, examples=3)
  assert wrong == {'16': {'0.0': 0.0, '0.5': 0.0, '1.0': 0.0}}
  assert [k for k in report['16']] == [retrieval.depth_key(d) for d in depths]
  assert list(map(retrieval.depth_key, passkey.EVAL_DEPTHS)) == [
      '0.0', '0.1', '0.2', '0.3', '0.4', '0.5', '0.6', '0.7', '0.8', '0.9', '1.0']
  lines = retrieval.summary_lines(report)
  assert len(lines) == 4 and lines[1].split()[-1] == '100%' and lines[3].split() == [
      'length', '32:', '100%', '100%', '100%']
  assert retrieval.summary_lines(wrong)[2].split()[-1] == '0%'
  assert retrieval.summary_lines({}) == []  # a run that is not a passkey run prints nothing
  path = plots.plot_retrieval(str(tmp_path), report, 'passkey', train_length=16)
  assert os.path.getsize(path) > 1000


def test_the_default_report_is_1_2_4_8_times_the_training_length():
  config = _config(max_length=64)
  assert validation_passkey.retrieval_lengths(config, []) == [64, 128, 256, 512]
  assert validation_passkey.retrieval_lengths(config, [0.5, 3]) == [32, 192]


def test_retrieval_rows_at_randomized_training_ids(tok, tmp_path):
  """--position_ids random/spaced: a randomized-positions run's retrieval rows get sorted distinct
  ids from [0, N) (random: per row, the same whoever evaluates it); sequential rows get none."""
  config = _config(max_length=16)
  config.model.random_positions_max = 64
  seen = []

  def model(batch):
    """Right exactly when every row's ids are sorted, distinct and in [0, 64)."""
    logits = _reader(tok, True)(batch)
    if 'positions' not in batch:
      seen.append(None)
      return logits
    ids = batch['positions']
    seen.append(ids.shape)
    good = (jnp.all(jnp.diff(ids, axis=-1) > 0, axis=-1) & (ids.min(-1) >= 0)
            & (ids.max(-1) < 64))
    return logits - jnp.where(good, 0.0, 10.0)[:, None, None] * jax.nn.one_hot(
        jnp.argmax(logits, -1), tok.vocab_size)

  for kind in ('sequential', 'random', 'spaced'):
    seen.clear()
    report = retrieval.retrieval(config, model, tok, [16, 32], (0.0, 1.0), examples=3,
                                 position_ids=kind)
    assert report == {'16': {'0.0': 1.0, '1.0': 1.0}, '32': {'0.0': 1.0, '1.0': 1.0}}
    if kind == 'sequential':
      assert seen == [None, None]  # one trace per length, without ids
    else:
      assert [s[-1] for s in seen] == [16, 32]
  # The check bites: ids beyond the model's N are wrong everywhere.
  config.model.random_positions_max = 128
  assert retrieval.retrieval(config, model, tok, [32], (0.0,), examples=3,
                             position_ids='spaced') == {'32': {'0.0': 0.0}}
  run = dict(split=['test'], translate=[], stream_split='test', rope_scaling=None)
  _fake_run(tmp_path / 'rand', position='rope', random_positions_max=256)
  eval_checks.check_eval_run(str(tmp_path / 'rand'), lengths=[], position_ids='random', **run)
  with pytest.raises(options.ConfigError, match=r'^--position_ids=spaced: a window of 512 '
                     r'tokens needs that many ids of model.random_positions_max=256; valid: '
                     r'--lengths up to 8$'):
    eval_checks.check_eval_run(str(tmp_path / 'rand'), lengths=[16], position_ids='spaced', **run)
  _fake_run(tmp_path / 'plain', position='rope')
  with pytest.raises(options.ConfigError, match=r'^--position_ids=random draws ids from'):
    eval_checks.check_eval_run(str(tmp_path / 'plain'), lengths=[], position_ids='random', **run)
