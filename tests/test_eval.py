"""eval.py: greedy decoding equals a step-by-step argmax loop; eval.json and the plot are written."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import decoder_only
from training import validation
from models import decoding
import models
from tools import plots
from training import evaluation
from training import loop


def test_greedy_translate_equals_python_argmax_loop():
  config = validation.resolve(decoder_only.get_config('quick'))
  model = models.build(config.model, 30, 16, rngs=nnx.Rngs(0))
  prompts = [[1, 7, 8, 3], [1, 9, 3], [1, 10, 11, 12, 13, 3]]
  got = decoding.greedy_translate(model, prompts, length=16, max_new=6, eos_id=2, batch_size=2)
  for prompt, out in zip(prompts, got):
    seq = list(prompt)
    want = []
    for _ in range(6):
      logits = model({'inputs': jnp.asarray([seq + [0] * (16 - len(seq))])})
      nxt = int(jnp.argmax(logits[0, len(seq) - 1]))
      if nxt == 2 or len(seq) >= 16:
        break
      want.append(nxt)
      seq.append(nxt)
    assert out == want


def test_eval_writes_json_and_plot(tmp_path):
  config = validation.resolve(decoder_only.get_config('quick'))
  config.data.data_dir = str(tmp_path / 'tfds')
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
