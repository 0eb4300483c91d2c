"""eval.py: greedy decoding equals a step-by-step argmax loop; eval.json and the plot are
written."""

import json
import os

import numpy as np
import pytest

from configs import decoder_only
from training import validation
from tools.plots import run_pictures as plots
from training import evaluation
from training import loop



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
  assert 0.0 <= saved['exact_match'] <= 1.0 and 0.0 <= saved['token_accuracy'] <= 1.0
  assert saved['translation']['test']['n'] == 20
  assert os.path.getsize(result['loss_curve']) > 1000
