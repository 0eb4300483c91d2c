"""eval.py: greedy decoding equals a step-by-step argmax loop; eval.json and the plot are
written."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu
from flax import nnx

from configs import decoder_only
from data import pipeline
from training import validation
from tools.plots import run_pictures as plots
from training import evaluation
from training import loop


def argmax_loop(argmax_of, prompts, length, max_new, eos_id):
  """Greedy continuations by a plain loop, no cache: every token is the argmax of a full forward
  pass over the rows written so far (`argmax_of(tokens)`: `[n, length]` -> `[n, length]`, the
  argmax at each position). A row stops at eos (excluded), after `max_new` tokens or when the
  buffer is full."""
  tokens = np.zeros((len(prompts), length), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  cursor = [len(p) for p in prompts]
  out = [[] for _ in prompts]
  done = [False] * len(prompts)
  for _ in range(max_new):
    best = np.asarray(argmax_of(jnp.asarray(tokens)))
    for i in range(len(prompts)):
      if done[i]:
        continue
      token = int(best[i, cursor[i] - 1])
      if token == eos_id:
        done[i] = True
        continue
      out[i].append(token)
      tokens[i, cursor[i]] = token
      cursor[i] += 1
      done[i] = cursor[i] >= length
  return out


def decoder_only_greedy(config, model, tokenizer, examples):
  """The greedy continuations of each example's `<bos> source <sep>` by `argmax_loop` over the
  decoder-only model's full forward, with eval.py's budget (one token more than the longest
  reference) and buffer (at least data.max_length)."""
  prompts = [[tokenizer.bos_id, *e['source_ids'], tokenizer.sep_id] for e in examples]
  max_new = max(len(e['target_ids']) for e in examples) + 1
  length = max(config.data.max_length, max(len(p) for p in prompts) + max_new)
  graphdef, params = nnx.split(model)
  argmax_of = jax.jit(lambda params, tokens: jnp.argmax(
      nnx.merge(graphdef, params)({'inputs': tokens}), -1))
  return argmax_loop(functools.partial(argmax_of, params), prompts, length, max_new,
                     tokenizer.eos_id)


def check_translation(reported, hyps, examples, tokenizer):
  """Asserts that an evaluation's translation figures of `examples` (eval.json's
  `translation[split]`) are those of the hypotheses `hyps` (token lists): its samples' outputs,
  exact match (detokenized text equal to the reference as written), token accuracy (reference
  tokens and the final eos at the same index) and corpus BLEU (sacrebleu)."""
  outputs = [tokenizer.decode(h) for h in hyps]
  refs = [e['target'] for e in examples]
  assert reported['n'] == len(examples)
  assert [s['output'] for s in reported['samples']] == outputs[:5], (reported['samples'], outputs)
  assert reported['exact_match'] == sum(o == r for o, r in zip(outputs, refs)) / len(refs)
  eos = tokenizer.eos_id
  correct = sum(a == b for h, e in zip(hyps, examples)
                for a, b in zip(h + [eos], e['target_ids'] + [eos]))
  total = sum(len(e['target_ids']) + 1 for e in examples)
  assert reported['token_accuracy'] == correct / total, (reported['token_accuracy'], correct, total)
  assert reported['bleu'] == pytest.approx(sacrebleu.corpus_bleu(outputs, [refs]).score)


def check_decoder_only_eval(workdir, split, n):
  """Asserts that eval.json of `workdir` reports the translation of the first `n` examples of
  `split` that `decoder_only_greedy` decodes from the run's newest checkpoint; returns its
  exact match."""
  with open(os.path.join(workdir, 'eval.json')) as f:
    saved = json.load(f)
  config, graphdef, variables, _ = evaluation.load_run(str(workdir))
  tokenizer = pipeline.get_tokenizer(config.data)
  examples = pipeline.load_examples(config.data, split)[:n]
  hyps = decoder_only_greedy(config, nnx.merge(graphdef, variables), tokenizer, examples)
  check_translation(saved['translation'][split], hyps, examples, tokenizer)
  assert saved['exact_match'] == saved['translation'][split]['exact_match']
  assert saved['token_accuracy'] == saved['translation'][split]['token_accuracy']
  return saved['exact_match']


def test_eval_writes_json_and_plot(data_dir, tmp_path):
  config = validation.resolve(decoder_only.get_config('quick'))
  config.data.data_dir = str(data_dir)
  workdir = str(tmp_path / 'run')
  with pytest.raises(FileNotFoundError, match='config.json'):
    evaluation.evaluate_run(workdir, ['test'])
  loop.train_and_evaluate(config, workdir)
  result, run = evaluation.evaluate_run(workdir, ['validation', 'test'], max_examples=20)
  plots.write_eval_outputs(workdir, result, run, ['validation', 'test'])
  with open(os.path.join(workdir, 'eval.json')) as f:
    saved = json.load(f)
  assert saved['step'] == config.train.steps
  assert set(saved['loss']) == {'validation', 'test'}
  assert np.isclose(saved['perplexity']['test'], np.exp(saved['loss']['test']))
  # The figures are those of the translations a plain argmax loop decodes (no cache).
  check_decoder_only_eval(workdir, 'test', 20)
  assert os.path.getsize(result['loss_curve']) > 1000
