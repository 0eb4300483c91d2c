"""Hugging Face checkpoints: logits equal to transformers', cached greedy decoding, round trips.

The fixtures (tests/fixtures/hf/, written by tests/fixtures/make_hf_fixtures.py with transformers)
hold tiny random models of each family with transformers' float32 logits, last hidden states and
greedy continuation of one row.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from models import decoding
from tools.hf import __main__ as cli
from tools.hf import convert
from tools.hf import export
from models.hf import families
from models.hf import weights
from training import state as state_lib
from layers import sharding

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'fixtures', 'hf')
CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
EOS = 2  # the fixtures' eos_token_id


def _expected(case):
  return dict(np.load(os.path.join(FIXTURES, case, 'expected.npz')))


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """{case: workdir} of every fixture, imported once for the module."""
  root = tmp_path_factory.mktemp('hf')
  out = {}
  for case in CASES:
    out[case] = str(root / case)
    convert.import_checkpoint(os.path.join(FIXTURES, case), out[case], log=lambda *_: None)
  return out


def _params(workdir):
  _, model, _ = export.load(workdir)
  leaves, _ = convert.param_paths(nnx.state(model, nnx.Param))
  return {path: np.asarray(leaf) for path, leaf in leaves}


@pytest.mark.parametrize('case', CASES)
def test_logits_equal_transformers(imported, case):
  want = _expected(case)
  _, model, _ = export.load(imported[case])
  batch = {'inputs': want['ids'][None].astype(np.int32)}
  logits = np.asarray(model(batch))[0]
  np.testing.assert_allclose(logits, want['logits'], atol=1e-5, rtol=0)
  hidden = np.asarray(model.features(batch))[0]  # after the final norm, as transformers' last
  np.testing.assert_allclose(hidden, want['hidden'], atol=1e-5, rtol=0)


@pytest.mark.parametrize('case', CASES)
def test_greedy_decoding_with_cache_matches(imported, case):
  want = _expected(case)
  _, model, _ = export.load(imported[case])
  prompt = [int(t) for t in want['ids'][:int(want['prompt'])]]
  got = decoding.generate(model, [prompt], max_new=len(want['greedy']) - len(prompt),
                          eos_id=EOS, method='greedy')[0]
  theirs = [int(t) for t in want['greedy'][len(prompt):]]
  theirs = theirs[:theirs.index(EOS)] if EOS in theirs else theirs
  assert got == theirs


def test_logits_command_writes_the_rows_logits(imported, tmp_path):
  want = _expected('llama')
  out = str(tmp_path / 'logits.npy')
  cli.main(['logits', f'--workdir={imported["llama"]}',
            '--ids=' + ','.join(str(int(i)) for i in want['ids']), f'--out={out}'])
  np.testing.assert_allclose(np.load(out), want['logits'], atol=1e-5, rtol=0)


@pytest.mark.parametrize('case', CASES)
def test_export_then_import_is_bit_identical(imported, case, tmp_path):
  hf_dir, again = str(tmp_path / 'hf'), str(tmp_path / 'again')
  export.export_checkpoint(imported[case], hf_dir, log=lambda *_: None)
  with open(os.path.join(hf_dir, 'config.json')) as f:
    exported = json.load(f)
  assert exported['model_type'] == json.load(open(os.path.join(FIXTURES, case,
                                                               'config.json')))['model_type']
  convert.import_checkpoint(hf_dir, again, log=lambda *_: None)
  first, second = _params(imported[case]), _params(again)
  assert first.keys() == second.keys()
  for path in first:
    np.testing.assert_array_equal(first[path], second[path], err_msg=str(path))
  with open(os.path.join(imported[case], 'config.json')) as f1, open(
      os.path.join(again, 'config.json')) as f2:
    # linformer_length is resolved from data.max_length, which follows the exported context
    first_model, second_model = json.load(f1)['model'], json.load(f2)['model']
    for model in (first_model, second_model):
      model.pop('linformer_length')
    assert first_model == second_model


def test_a_bfloat16_export_of_an_import_is_bit_identical(imported, tmp_path):
  """The fixtures' weights are bfloat16: exported as bfloat16 they round-trip exactly too."""
  hf_dir, again = str(tmp_path / 'hf'), str(tmp_path / 'again')
  cli.main(['export', f'--workdir={imported["qwen3"]}', f'--out={hf_dir}', '--dtype=bfloat16'])
  with open(os.path.join(hf_dir, 'config.json')) as f:
    assert json.load(f)['torch_dtype'] == 'bfloat16'
  size = os.path.getsize(os.path.join(hf_dir, 'model.safetensors'))
  assert size < 1.02 * os.path.getsize(os.path.join(FIXTURES, 'qwen3', 'model.safetensors'))
  convert.import_checkpoint(hf_dir, again, log=lambda *_: None)
  first, second = _params(imported['qwen3']), _params(again)
  for path in first:
    np.testing.assert_array_equal(first[path], second[path], err_msg=str(path))


def test_gpt2_saved_from_its_base_class_imports(tmp_path):
  """The Hub's GPT-2 names its tensors `wte.weight`, `h.0...` (no `transformer.`): imported as
  transformers loads it, with the same logits."""
  from safetensors.numpy import save_file
  import ml_dtypes
  folder = tmp_path / 'gpt2'
  shutil.copytree(os.path.join(FIXTURES, 'gpt2'), folder)
  tensors = _load_bf16(folder)
  save_file({k.removeprefix('transformer.'): v.astype(ml_dtypes.bfloat16)
             for k, v in tensors.items()}, str(folder / 'model.safetensors'),
            metadata={'format': 'pt'})
  workdir = str(tmp_path / 'wd')
  convert.import_checkpoint(str(folder), workdir, log=lambda *_: None)
  want = _expected('gpt2')
  np.testing.assert_allclose(export.logits(workdir, want['ids']), want['logits'], atol=1e-5,
                             rtol=0)


def test_export_in_shards_with_an_index_round_trips(imported, tmp_path):
  hf_dir, again = str(tmp_path / 'hf'), str(tmp_path / 'again')
  export.export_checkpoint(imported['llama'], hf_dir, shard_bytes=60_000, log=lambda *_: None)
  shards = sorted(f for f in os.listdir(hf_dir) if f.endswith('.safetensors'))
  assert len(shards) > 3 and shards[0].startswith('model-00001-of-')
  assert os.path.isfile(os.path.join(hf_dir, 'model.safetensors.index.json'))
  convert.import_checkpoint(hf_dir, again, log=lambda *_: None)
  first, second = _params(imported['llama']), _params(again)
  for path in first:
    np.testing.assert_array_equal(first[path], second[path], err_msg=str(path))


def test_rope_layout_error_is_caught(imported, tmp_path):
  """A checkpoint whose q/k are in the interleaved layout imports with logits far from
  transformers'; permuting them to rotate-half (what a Meta-layout conversion must do) restores
  them exactly. So the parity test catches a wrong RoPE layout."""
  from safetensors.numpy import save_file
  import ml_dtypes
  src = os.path.join(FIXTURES, 'llama')
  wrong, fixed = tmp_path / 'wrong', tmp_path / 'fixed'
  shutil.copytree(src, wrong)
  shutil.copytree(src, fixed)
  tensors = {k: v.astype(np.float32) for k, v in _load_bf16(src).items()}
  n, k, h = 4, 2, 16
  half_to_interleaved = np.argsort(np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)]))
  for name in list(tensors):
    heads = n if 'q_proj' in name else k if 'k_proj' in name else None
    if heads:
      w = tensors[name]
      tensors[name] = w.reshape(heads, h, -1)[:, half_to_interleaved].reshape(w.shape)
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
            str(wrong / 'model.safetensors'), metadata={'format': 'pt'})
  for name in list(tensors):
    heads = n if 'q_proj' in name else k if 'k_proj' in name else None
    if heads:
      tensors[name] = weights.interleaved_to_half(tensors[name], heads, h)
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()},
            str(fixed / 'model.safetensors'), metadata={'format': 'pt'})
  want = _expected('llama')
  batch = {'inputs': want['ids'][None].astype(np.int32)}
  for folder, close in ((wrong, False), (fixed, True)):
    workdir = str(tmp_path / f'wd_{folder.name}')
    convert.import_checkpoint(str(folder), workdir, log=lambda *_: None)
    _, model, _ = export.load(workdir)
    error = np.abs(np.asarray(model(batch))[0] - want['logits']).max()
    assert (error < 1e-4) == close, (folder.name, error)
    if not close:
      assert error > 1e-2


def _load_bf16(folder):
  from safetensors import safe_open
  with safe_open(os.path.join(folder, 'model.safetensors'), 'flax') as f:
    return {k: np.asarray(f.get_tensor(k).astype(np.float32)) for k in f.keys()}


LLAMA2_7B = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_size': 4096,
    'intermediate_size': 11008, 'num_attention_heads': 32, 'num_hidden_layers': 32,
    'num_key_value_heads': 32, 'max_position_embeddings': 4096, 'rms_norm_eps': 1e-5,
    'vocab_size': 32000, 'tie_word_embeddings': False, 'hidden_act': 'silu', 'rope_theta': 10000.0,
    'rope_scaling': None, 'bos_token_id': 1, 'eos_token_id': 2}


def test_a_7b_mapping_checks_on_an_abstract_model():
  """Every tensor name and shape of Llama 2 7B against `jax.eval_shape` of the model: a shape or
  name error shows before a user downloads 13 GB. 291 tensors, 6,738,415,616 parameters."""
  config = convert.model_config(LLAMA2_7B)
  tensors = families.tensor_list(families.resolved_model(config))
  mesh = sharding.make_mesh(config.mesh)
  _, _, abstract = state_lib.abstract_state(config, config.model.vocab_size, mesh)
  convert.check_against_model(tensors, abstract['params'])
  assert len(tensors) == 291
  assert sum(int(np.prod(t.shape)) for t in tensors) == 6_738_415_616
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract['params'])) == 6_738_415_616
