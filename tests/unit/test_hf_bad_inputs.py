"""`python -m tools.hf`: each bad input is one `hf:` line, exit status 2, nothing written."""

import json
import os
import shutil

import pytest

from tools.hf import __main__ as cli

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'fixtures', 'hf')


def _run(capsys, argv):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2
  assert len(err.splitlines()) == 1 and err.startswith('hf: '), err
  return err


def _copy(tmp_path, case='llama'):
  folder = tmp_path / 'src'
  shutil.copytree(os.path.join(FIXTURES, case), folder)
  return folder


def _edit_config(folder, **fields):
  path = folder / 'config.json'
  config = json.loads(path.read_text())
  config.update(fields)
  path.write_text(json.dumps(config))


def _import(capsys, folder, workdir):
  err = _run(capsys, ['import', f'--hf_dir={folder}', f'--workdir={workdir}'])
  assert not os.path.exists(workdir) or not os.listdir(workdir)
  assert not os.path.exists(str(workdir) + '.partial')
  return err


def test_missing_shard(tmp_path, capsys):
  folder = _copy(tmp_path)
  os.rename(folder / 'model.safetensors', folder / 'model-00001-of-00002.safetensors')
  names = json.loads((folder / 'config.json').read_text())  # any tensor: map them all
  del names
  from safetensors import safe_open
  with safe_open(str(folder / 'model-00001-of-00002.safetensors'), 'flax') as f:
    keys = list(f.keys())
  weight_map = {k: ('model-00001-of-00002.safetensors' if i % 2 else
                    'model-00002-of-00002.safetensors') for i, k in enumerate(keys)}
  (folder / 'model.safetensors.index.json').write_text(json.dumps({'weight_map': weight_map}))
  err = _import(capsys, folder, tmp_path / 'wd')
  assert 'model-00002-of-00002.safetensors' in err and 'missing' in err


def test_truncated_shard(tmp_path, capsys):
  folder = _copy(tmp_path)
  data = (folder / 'model.safetensors').read_bytes()
  (folder / 'model.safetensors').write_bytes(data[:len(data) // 2])
  err = _import(capsys, folder, tmp_path / 'wd')
  assert 'truncated or unreadable' in err


def test_shape_that_does_not_match_the_config(tmp_path, capsys):
  folder = _copy(tmp_path)
  _edit_config(folder, intermediate_size=96)
  err = _import(capsys, folder, tmp_path / 'wd')
  assert 'mlp.' in err and 'shape [128, 64]' in err and '[96, 64]' in err


def test_unknown_model_type(tmp_path, capsys):
  folder = _copy(tmp_path)
  _edit_config(folder, model_type='mixtral')
  err = _import(capsys, folder, tmp_path / 'wd')
  assert "model_type='mixtral'" in err and 'llama' in err


def test_unsupported_rope_type_and_moe_fields(tmp_path, capsys):
  folder = _copy(tmp_path)
  _edit_config(folder, rope_parameters={'rope_type': 'longrope', 'rope_theta': 10000.0})
  assert "'longrope'" in _import(capsys, folder, tmp_path / 'wd')
  _edit_config(folder, rope_parameters=None, num_local_experts=8)
  assert 'num_local_experts' in _import(capsys, folder, tmp_path / 'wd')


def test_a_field_it_does_not_map_is_refused(tmp_path, capsys):
  """e.g. SmolLM3's no_rope_layers on a llama model_type: dropping it would change the logits."""
  folder = _copy(tmp_path)
  _edit_config(folder, no_rope_layers=[1, 0])
  err = _import(capsys, folder, tmp_path / 'wd')
  assert 'no_rope_layers=[1, 0]' in err and 'llama' in err


def test_hf_dir_that_is_a_workdir_and_workdir_that_is_an_hf_folder(tmp_path, capsys):
  wd = tmp_path / 'wd'
  cli.main(['import', f'--hf_dir={os.path.join(FIXTURES, "gpt2")}', f'--workdir={wd}'])
  capsys.readouterr()
  assert 'is an attnlab workdir' in _run(
      capsys, ['import', f'--hf_dir={wd}', f'--workdir={tmp_path / "other"}'])
  assert not os.path.exists(tmp_path / 'other')
  folder = _copy(tmp_path)
  before = sorted(os.listdir(folder))
  assert 'is a Hugging Face folder' in _run(
      capsys, ['import', f'--hf_dir={os.path.join(FIXTURES, "gpt2")}', f'--workdir={folder}'])
  assert sorted(os.listdir(folder)) == before


def test_export_of_a_config_the_family_cannot_express(tmp_path, capsys):
  wd = tmp_path / 'wd'
  cli.main(['import', f'--hf_dir={os.path.join(FIXTURES, "llama")}', f'--workdir={wd}'])
  capsys.readouterr()
  config = json.loads((wd / 'config.json').read_text())
  config['model']['position'] = 'alibi'
  (wd / 'config.json').write_text(json.dumps(config))
  err = _run(capsys, ['export', f'--workdir={wd}', f'--out={tmp_path / "out"}'])
  assert "model.position='alibi'" in err and 'llama' in err
  assert not os.path.exists(tmp_path / 'out')
  err = _run(capsys, ['export', f'--workdir={wd}', f'--out={tmp_path / "out"}',
                      '--model_type=gpt2'])
  assert not os.path.exists(tmp_path / 'out')


def test_bad_ids(tmp_path, capsys):
  assert 'comma-separated integers' in _run(
      capsys, ['logits', f'--workdir={tmp_path}', '--ids=1,x', f'--out={tmp_path / "o.npy"}'])


@pytest.mark.parametrize('fields,words', [
    ({'partial_rotary_factor': 0.5}, 'partial_rotary_factor=0.5'),
    ({'rope_scaling': {'rope_type': 'linear', 'factor': 4.0}}, 'both rope_scaling and'),
    ({'rope_parameters': {'rope_type': 'default', 'rope_theta': 1e4, 'full_attention': {}}},
     "rope key 'full_attention'"),
    ({'rope_parameters': {'rope_type': 'linear', 'rope_theta': 1e4}}, 'factor=None'),
    ({'hidden_size': None}, 'hidden_size=None'),
], ids=['partial-rotary', 'both-rope-forms', 'per-layer-rope', 'no-factor', 'no-hidden-size'])
def test_config_fields_it_cannot_reproduce(tmp_path, capsys, fields, words):
  folder = _copy(tmp_path)
  _edit_config(folder, **fields)
  assert words in _import(capsys, folder, tmp_path / 'wd')


def test_export_and_logits_of_a_folder_that_is_not_a_workdir(tmp_path, capsys):
  hf_folder = os.path.join(FIXTURES, 'llama')
  err = _run(capsys, ['export', f'--workdir={hf_folder}', f'--out={tmp_path / "out"}'])
  assert 'is a Hugging Face folder' in err and not os.path.exists(tmp_path / 'out')
  err = _run(capsys, ['logits', f'--workdir={tmp_path}', '--ids=1,2', f'--out={tmp_path / "o"}'])
  assert 'not an attnlab workdir' in err


def test_ids_outside_the_vocabulary(tmp_path, capsys):
  wd = tmp_path / 'wd'
  cli.main(['import', f'--hf_dir={os.path.join(FIXTURES, "gpt2")}', f'--workdir={wd}'])
  capsys.readouterr()
  err = _run(capsys, ['logits', f'--workdir={wd}', '--ids=1,96', f'--out={tmp_path / "o.npy"}'])
  assert 'holds 96, outside the vocabulary; valid: 0 to 95' in err


def test_a_partial_folder_the_tool_did_not_make_is_left_alone(tmp_path, capsys):
  wd = tmp_path / 'wd'
  (tmp_path / 'wd.partial').mkdir()
  (tmp_path / 'wd.partial' / 'notes.txt').write_text('mine')
  err = _run(capsys, ['import', f'--hf_dir={os.path.join(FIXTURES, "gpt2")}', f'--workdir={wd}'])
  assert 'was not left by tools.hf' in err
  assert (tmp_path / 'wd.partial' / 'notes.txt').read_text() == 'mine'
  assert not wd.exists()
