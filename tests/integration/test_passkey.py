"""The passkey retrieval task end to end, one seed, a few steps: training then eval.py writing the
retrieval grid into eval.json and retrieval.png, a bad field refused in one line with exit status
2, and the context-extension path (train.init_from at 4L with each RoPE scaling)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import passkey as passkey_config
from data import passkey
from data import pipeline
from tests.helpers import ROOT, metric_rows
from training import evaluation
from training import loop
from training import validation

L = 16  # the smallest rows that keep some filler around the key: quick to generate and to run


def _config(data_dir, **train):
  config = validation.resolve(passkey_config.get_config('quick'))
  config.data.update(data_dir=str(data_dir), max_length=L)
  config.train.update(steps=2, log_every=1, eval_every=1000, checkpoint_every=1000,
                      warmup_steps=0, eval_batches=1, **train)
  validation.validate(config)
  return config


def _cli(*args):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)


def test_train_then_eval_writes_the_retrieval_grid(tmp_path):
  workdir = tmp_path / 'run'
  loop.train_and_evaluate(_config(tmp_path / 'tfds'), str(workdir))
  out = _cli(os.path.join(ROOT, 'eval.py'), f'--workdir={workdir}', '--retrieval_examples=2',
             '--split=validation')
  assert out.returncode == 0, out.stderr[-2000:]
  with open(workdir / 'eval.json') as f:
    result = json.load(f)
  assert list(result['retrieval']) == ['16', '32', '64', '128']  # 1, 2, 4, 8 x L
  depths = [f'{d / 10:.1f}' for d in range(11)]
  for row in result['retrieval'].values():
    assert list(row) == depths and all(a in (0.0, 0.5, 1.0) for a in row.values())
  assert result['retrieval_examples'] == 2 and result['translation'] == {}
  assert os.path.getsize(result['retrieval_plot']) > 1000
  assert 'length 128:' in out.stdout
  # A depth outside [0, 1]: one line, exit 2, before anything is compiled or written.
  bad = _cli(os.path.join(ROOT, 'train.py'), f'--config={ROOT}/configs/passkey.py:quick',
             f'--workdir={tmp_path / "bad"}', '--config.data.passkey_depths=(0.0, 1.5)')
  assert bad.returncode == 2 and bad.stderr.count('\n') == 1, bad.stderr[-2000:]
  assert 'config error: data.passkey_depths=(0.0, 1.5): depth 1.5 is outside [0, 1]' in bad.stderr
  assert not os.path.exists(tmp_path / 'bad')


@pytest.mark.parametrize('scalings', [('none', 'pi', 'ntk', 'yarn')])
def test_fine_tuning_at_4l_with_each_rope_scaling_runs(tmp_path, scalings, capsys):
  base = _config(tmp_path / 'tfds')
  loop.train_and_evaluate(base, str(tmp_path / 'base'))
  for scaling in scalings:
    capsys.readouterr()
    tune = _config(tmp_path / 'tfds', init_from=str(tmp_path / 'base'))
    tune.data.max_length = 4 * L
    tune.model.rope_scaling = scaling
    tune.model.rope_scaling_factor = 1.0 if scaling == 'none' else 4.0
    validation.validate(tune)
    loop.train_and_evaluate(tune, str(tmp_path / scaling))
    assert [r['step'] for r in metric_rows(tmp_path / scaling)] == [1, 2]
    # It started from the base run's parameters (at step 0), not from a fresh draw.
    assert f'train: parameters from {tmp_path / "base"} (its step 2)' in capsys.readouterr().err
  result, run = evaluation.evaluate_run(str(tmp_path / 'yarn'), ['validation'], lengths=[1.0],
                                        retrieval_examples=1)
  assert list(result['retrieval']) == [str(4 * L)]
  assert result['retrieval'][str(4 * L)] == _retrieved(run, 4 * L)
  assert result['accuracy']['validation'] == _value_accuracy(run, 'validation')


def _retrieved(run, length):
  """{depth: 1.0 or 0.0} of the one retrieval example per depth at `length`: whether the argmax
  of the model's logits at the value's positions of the row `<bos> prompt value[:-1]` (exactly
  `length` tokens) is the value."""
  spec = passkey.spec_from_config(run.config.data)
  tok = run.tokenizer
  out = {}
  for depth in passkey.EVAL_DEPTHS:
    (prompt, value), = passkey.retrieval_examples(spec, length, depth, 1)
    value = tok.encode(' '.join(value))
    inputs = [tok.bos_id, *tok.encode(' '.join(prompt)), *value][:-1]
    assert len(inputs) == length
    logits = run.model({'inputs': jnp.asarray([inputs])})[0]  # [length, V]
    predicted = np.asarray(jnp.argmax(logits[length - len(value):], -1)).tolist()
    out[f'{depth:.1f}'] = 1.0 if predicted == value else 0.0
  return out


def _value_accuracy(run, split):
  """k / n over every row of `split`: n value tokens (weight 1), k of them the argmax of the
  model's logits at their position."""
  config = run.config
  graphdef, params = nnx.split(run.model)
  argmax_of = jax.jit(lambda p, batch: jnp.argmax(nnx.merge(graphdef, p)(batch), -1))
  hits = total = 0
  for batch in pipeline.make_iterator(config.data, split, config.train.batch_size,
                                      shuffle=False, repeat=False, drop_remainder=False):
    weights = np.asarray(batch['weights'])
    assert set(np.unique(weights)) <= {0.0, 1.0}
    predicted = np.asarray(argmax_of(params, {k: jnp.asarray(v) for k, v in batch.items()}))
    hits += int(np.sum((predicted == batch['targets']) * weights))
    total += int(np.sum(weights))
  assert total == passkey.SPLITS[split]  # one value token a row
  return hits / total
