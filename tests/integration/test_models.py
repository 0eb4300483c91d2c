"""Models: MLM masking statistics, each architecture's loss falls, eval.py translates every arch."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import encoder_decoder
from configs import encoder_only
from configs import rnn_seq2seq
from data import pipeline
from tests.integration.test_eval import argmax_loop, check_translation
from training import validation
from tools.plots import run_pictures as plots
from training import evaluation
from training import loop

CONFIGS = {'encoder_only': encoder_only, 'encoder_decoder': encoder_decoder,
           'rnn_seq2seq': rnn_seq2seq}


def reference_translations(arch, model, tokenizer, examples):
  """Each example's translation by the architecture's translation form, recomputed with plain
  forward passes (no cache): encoder_only fills a target of `<mask>`s of the reference's length in
  one pass (argmax at each); the source-to-target archs decode from `<bos>` over `source <eos>` by
  `argmax_loop`, with eval.py's budget (one token more than the longest reference)."""
  graphdef, params = nnx.split(model)
  argmax_of = jax.jit(lambda p, batch: jnp.argmax(nnx.merge(graphdef, p)(batch), -1))
  if arch == 'encoder_only':
    rows = [[tokenizer.bos_id, *e['source_ids'], tokenizer.sep_id,
             *[tokenizer.mask_id] * len(e['target_ids']), tokenizer.eos_id] for e in examples]
    inputs = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for i, r in enumerate(rows):
      inputs[i, :len(r)] = r
    segment_ids = (inputs > 0).astype(np.int32)
    best = np.asarray(argmax_of(params, {'inputs': inputs, 'segment_ids': segment_ids}))
    return [best[i, len(e['source_ids']) + 2:][:len(e['target_ids'])].tolist()
            for i, e in enumerate(examples)]
  sources = [e['source_ids'] + [tokenizer.eos_id] for e in examples]
  width = max(len(x) for x in sources)
  real = np.arange(width)[None] < np.asarray([len(x) for x in sources])[:, None]
  src = {'src_inputs': np.zeros((len(sources), width), np.int32),
         'src_segment_ids': real.astype(np.int32),
         'src_positions': np.where(real, np.arange(width)[None], 0).astype(np.int32)}
  for i, x in enumerate(sources):
    src['src_inputs'][i, :len(x)] = x
  max_new = max(len(e['target_ids']) for e in examples) + 1
  # Every target slot is of the row's one segment (the causal mask hides the ones not written
  # yet); cross-attention masks the source padding only where the target has segment ids too.
  segment = np.ones((len(examples), 1 + max_new), np.int32)
  return argmax_loop(
      lambda tokens: argmax_of(params, {**src, 'tgt_inputs': tokens, 'tgt_segment_ids': segment}),
      [[tokenizer.bos_id]] * len(examples), 1 + max_new, max_new, tokenizer.eos_id)


def read_losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return {r['step']: r['loss'] for r in rows if r['split'] == 'train'}


@pytest.mark.parametrize('arch', sorted(CONFIGS))
def test_loss_falls_and_eval_translates(arch, data_dir, tmp_path):
  config = validation.resolve(CONFIGS[arch].get_config('quick'))
  config.data.data_dir = str(data_dir)
  # A warmup and cosine decay, the schedule the 0.8 below was set with (quick configs run at a
  # constant rate).
  config.train.update(steps=30, log_every=5, learning_rate=3e-3, eval_every=30,
                      checkpoint_every=30, schedule='cosine', warmup_steps=5)
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path))
  losses = read_losses(tmp_path)
  assert losses[30] < 0.8 * losses[5], losses
  result, run = evaluation.evaluate_run(str(tmp_path), ['test'], max_examples=8)
  plots.write_eval_outputs(str(tmp_path), result, run, ['test'], plot_attention=1)
  # Exact match, token accuracy, BLEU and the samples: those of the translations recomputed
  # without the decoding's cache.
  examples = pipeline.load_examples(run.config.data, 'test')[:8]
  hyps = reference_translations(arch, run.model, run.tokenizer, examples)
  check_translation(result['translation']['test'], hyps, examples, run.tokenizer)
  assert result['attention_plots'] and all(os.path.getsize(p) > 1000
                                           for p in result['attention_plots'])
