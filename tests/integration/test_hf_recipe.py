"""Context extension of a pretrained model, the recipe of docs/pretrained.md on the Llama fixture
(L = 16, its own 96-id tokenizer): import, fine-tune two steps with YaRN at 4L = 64 on a corpus
through configs/pretrained.py, evaluate at 2 x 64, then passkey retrieval with the imported
vocabulary (filler from the corpus, a digit pass key) from the fine-tuned parameters."""

import json
import math
import os
import random
import subprocess
import sys

from tests.helpers import ROOT, metric_rows

FIXTURE = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'llama')
STEPS = ['--config.train.log_every=1', '--config.train.eval_every=2',
         '--config.train.checkpoint_every=2']


def _corpus(folder):
  """Lines of lowercase words (the fixture tokenizer spells any of them)."""
  rng = random.Random(0)
  letters = 'abcdefghijklmnopqrstuvwxyz'
  os.makedirs(folder)
  for split, count in (('train', 60), ('validation', 12), ('test', 12)):
    with open(os.path.join(folder, f'{split}.txt'), 'w') as f:
      for _ in range(count):
        words = [''.join(rng.choice(letters) for _ in range(rng.randint(2, 6)))
                 for _ in range(rng.randint(20, 60))]
        f.write(' '.join(words) + '.\n')
  return str(folder)


def _run(*args):
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)


def test_fine_tune_at_4l_then_evaluate_at_2x_and_passkey(tmp_path):
  corpus, data = _corpus(tmp_path / 'corpus'), f'--config.data.data_dir={tmp_path / "data"}'
  imported, tuned, passkey = (str(tmp_path / name) for name in ('imported', 'yarn4', 'passkey'))
  out = _run('-m', 'tools.hf', 'import', f'--hf_dir={FIXTURE}', f'--workdir={imported}')
  assert out.returncode == 0, out.stderr[-3000:]
  out = _run('train.py', f'--config=configs/pretrained.py:from={imported},dir={corpus},quick',
             f'--workdir={tuned}', '--config.model.rope_scaling=yarn',
             '--config.model.rope_scaling_factor=4', '--config.data.max_length=64', data, *STEPS)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f'parameters from {imported}' in out.stderr
  rows = metric_rows(tuned)
  assert [r['step'] for r in rows] == [1, 2]
  # Started from the imported parameters (the line above); both steps' losses finite.
  assert all(math.isfinite(r['loss']) for r in rows), rows
  with open(os.path.join(tuned, 'config.json')) as f:
    model = json.load(f)['model']
  assert (model['rope_scaling'], model['rope_scaling_factor'], model['rope_original_length'],
          model['vocab_size']) == ('yarn', 4.0, 16, 96)
  # Its export carries the imported tokenizer (the fine-tune reads the source's copy).
  from tools.hf import export
  export.export_checkpoint(tuned, str(tmp_path / 'hf'), log=lambda *_: None)
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    with open(os.path.join(FIXTURE, name), 'rb') as a, open(tmp_path / 'hf' / name, 'rb') as b:
      assert a.read() == b.read(), name
  out = _run('eval.py', f'--workdir={tuned}', '--lengths=1,2', '--split=validation')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(tuned, 'eval.json')) as f:
    result = json.load(f)
  assert math.isfinite(result['loss']['validation'])
  at_2x = [r for r in result['extrapolation'] if r['length'] == 128]
  assert at_2x and all(math.isfinite(r['loss']) for r in at_2x), result['extrapolation']
  out = _run('train.py', f'--config=configs/pretrained.py:from={tuned},dir={corpus},task=passkey,'
             'quick', f'--workdir={passkey}', '--config.data.max_length=64', data, *STEPS)
  assert out.returncode == 0, out.stderr[-3000:]
  out = _run('eval.py', f'--workdir={passkey}', '--lengths=1,2', '--retrieval_examples=2',
             '--split=validation')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(os.path.join(passkey, 'eval.json')) as f:
    retrieval = json.load(f)['retrieval']
  assert sorted(int(k) for k in retrieval) == [64, 128], retrieval
