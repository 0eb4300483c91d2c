"""Models: MLM masking statistics, each architecture's loss falls, eval.py translates every arch."""

import json
import os

import pytest

from configs import encoder_decoder
from configs import encoder_only
from configs import rnn_seq2seq
from training import validation
from tools.plots import run_pictures as plots
from training import evaluation
from training import loop

CONFIGS = {'encoder_only': encoder_only, 'encoder_decoder': encoder_decoder,
           'rnn_seq2seq': rnn_seq2seq}


def read_losses(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  return {r['step']: r['loss'] for r in rows if r['split'] == 'train'}


@pytest.mark.parametrize('arch', sorted(CONFIGS))
def test_loss_falls_and_eval_translates(arch, data_dir, tmp_path):
  config = validation.resolve(CONFIGS[arch].get_config('quick'))
  config.data.data_dir = str(data_dir)
  config.train.update(steps=30, log_every=5, learning_rate=3e-3, eval_every=30,
                      checkpoint_every=30)
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path))
  losses = read_losses(tmp_path)
  assert losses[30] < 0.8 * losses[5], losses
  result, run = evaluation.evaluate_run(str(tmp_path), ['test'], max_examples=8)
  plots.write_eval_outputs(str(tmp_path), result, run, ['test'], plot_attention=1)
  t = result['translation']['test']
  assert t['n'] == 8 and 0.0 <= t['exact_match'] <= 1.0 and 0.0 <= t['bleu'] <= 100.0
  assert result['attention_plots'] and all(os.path.getsize(p) > 1000
                                           for p in result['attention_plots'])
