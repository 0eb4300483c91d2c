"""One-seed smoke runs of the long-context study files, every kind of cell for a few steps, through
the sweep runner and tools.compare as the studies run: the passkey study (position cells, the
randomized-positions evaluation variants, RoPE fine-tunes at 4L started from the RoPE cell) and the
long DeepNorm comparison. A wrapper of each sweep file points it at the test's data directory."""

import io
import json
import os

import pytest

from tests.helpers import ROOT
from tools.compare import comparison as compare
from tools.study import __main__ as study_cli
from tools.sweep import runner as sweep_runner

WRAPPER = '''
import importlib.util

_spec = importlib.util.spec_from_file_location('study', {path!r})
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def get_config(arg=None):
  config = study.get_config(arg)
  config.data.data_dir = {data_dir!r}
  return config


def get_sweep(arg=None):
  return {keep}(study.get_sweep(arg))


STUDY = study.STUDY
'''


def _wrapped(tmp_path, name, data_dir, keep=''):
  """The sweep file's quick form with its data in `data_dir`; `keep`: a lambda source that
  narrows its sweep (the cells one smoke run needs)."""
  path = tmp_path / f'{name}_smoke.py'
  path.write_text(WRAPPER.format(path=os.path.join(ROOT, 'configs', 'ablations', f'{name}.py'),
                                 data_dir=str(data_dir), keep=keep))
  return f'{path}:quick'


@pytest.fixture(scope='module')
def study_data(tmp_path_factory):
  """One data directory for the studies' datasets (each task its own, prepared on first use):
  the two code studies share the code corpus."""
  return tmp_path_factory.mktemp('study_tfds')


def _run(spec, sweep_dir, **kwargs):
  out = io.StringIO()
  sweep_runner.run_sweep(spec, str(sweep_dir), out=out, **kwargs)
  assert 'failed' not in out.getvalue(), out.getvalue()
  return out.getvalue()


def test_passkey_study_smoke(tmp_path, study_data):
  sweep_dir = tmp_path / 'passkey'
  _run(_wrapped(tmp_path, 'passkey_positions', study_data), sweep_dir, run_eval=True)
  cells = sorted(os.listdir(sweep_dir))
  assert len(cells) == 3, cells  # rope, randomized rope, the YaRN fine-tune
  randomized = sweep_dir / 'model.position=rope,model.random_positions_max=512,seed=0'
  for name in ('eval.json', 'eval_position_ids=random.json', 'eval_position_ids=spaced.json'):
    with open(randomized / name) as f:
      assert list(json.load(f)['retrieval']) == ['64', '128', '256', '512']
  tuned = [c for c in cells if c.startswith('data.max_length=256,model.rope_scaling=yarn')]
  with open(sweep_dir / tuned[0] / 'eval.json') as f:
    assert list(json.load(f)['retrieval']) == ['64', '256']  # L and 4L of the base
  table = compare.compare([str(sweep_dir)], str(tmp_path / 'cmp.png'))
  assert '| 64 tokens | 128 tokens | 256 tokens | 512 tokens |' in table
  assert table.count('[eval position_ids=') == 2 and '[eval rope_scaling=yarn_4]' in table
  assert os.path.getsize(tmp_path / 'cmp_retrieval.png') > 10_000


def test_deepnorm_long_smoke(tmp_path, data_dir):
  """The DeepNorm cell alone (12 layers compile slowly; the other two cells are placements the
  depth study's tests train, and test_sweep.py validates every cell of every sweep file)."""
  sweep_dir = tmp_path / 'deepnorm'
  keep = "(lambda sweep: dict(sweep, grid={'model.norm_position': ['deepnorm']}))"
  _run(_wrapped(tmp_path, 'deepnorm_long', data_dir, keep), sweep_dir, seeds=[0])
  cells = sorted(os.listdir(sweep_dir))
  assert cells == ['model.norm_position=deepnorm,seed=0']
  for cell in cells:
    with open(sweep_dir / cell / 'config.json') as f:
      config = json.load(f)
    assert config['model']['num_layers'] == 12 and config['train']['warmup_steps'] == 1
  table = compare.compare([str(sweep_dir)], str(tmp_path / 'cmp.png'))
  assert '| deepnorm | 1 |' in table, table  # one group, named by its directory; one run


def test_mqar_attention_study_smoke(tmp_path, study_data):
  """Dense and linear attention on the quick MQAR rows, evaluated (recall by pairs and distance),
  then compared against the dense cell with the statistics table and its JSON."""
  sweep_dir = tmp_path / 'mqar'
  keep = ("(lambda sweep: dict(sweep, cells=[c for c in sweep['cells'] if c['model.attention'] "
          "in ('dense', 'linear') and 'model.num_kv_heads' not in c]))")
  # In one command, as `python -m tools.study FILE:smoke --dir=DIR` runs it.
  printed = io.StringIO()
  head = study_cli.run_study(_wrapped(tmp_path, 'mqar_attention', study_data,
                                      keep).replace(':quick', ':smoke'),
                             str(sweep_dir), seeds=[0], out=printed)
  assert 'failed' not in printed.getvalue(), printed.getvalue()
  assert 'baseline: attention=dense;' in printed.getvalue()
  assert '| accuracy.test | attention=dense |' in head and '| baseline |' in head
  assert '| recall_pairs@16 |' not in head  # quick rows hold 4 pairs: the metric is absent
  cells = sorted(c for c in os.listdir(sweep_dir) if c.startswith('model.'))
  assert cells == ['model.attention=dense,seed=0', 'model.attention=linear,seed=0'], cells
  assert (sweep_dir / 'compare.txt').exists() and (sweep_dir / 'compare_intervals.png').exists()
  with open(sweep_dir / cells[0] / 'eval.json') as f:
    result = json.load(f)
  assert list(result['recall']['by_pairs']) == ['1', '2', '4', '8']  # quick: 4 pairs in 32 tokens
  assert 0.0 <= result['accuracy']['test'] <= 1.0 and result['recall']['by_distance']
  with open(sweep_dir / 'compare_stats.json') as f:
    written = json.load(f)
  found = written['cells']
  assert written['about']['baseline'] == 'attention=dense'
  assert found['attention=linear']['recall_pairs@4']['verdict'] == 'n/a'  # one seed: no test
  assert found['attention=dense']['accuracy.test']['verdict'] == 'baseline'
  assert '| accuracy.test | attention=linear |' in (sweep_dir / 'compare.txt').read_text()


def test_memorize_moe_study_smoke(tmp_path, study_data):
  """The dense 256 and MoE top-1 cells of the memorisation study, evaluated and compared."""
  sweep_dir = tmp_path / 'memorize'
  keep = ("(lambda sweep: dict(sweep, cells=[c for c in sweep['cells'] if c['model.d_ff'] == 256 "
          "and c.get('model.moe_top_k', 1) == 1]))")
  _run(_wrapped(tmp_path, 'memorize_moe', study_data, keep), sweep_dir, seeds=[0],
       run_eval=True)
  cells = sorted(os.listdir(sweep_dir))
  assert cells == ['model.d_ff=256,model.moe_capacity_factor=2.0,model.moe_experts=4,'
                   'model.moe_top_k=1,seed=0', 'model.d_ff=256,seed=0'], cells
  for cell in cells:
    with open(sweep_dir / cell / 'eval.json') as f:
      assert 0.0 <= json.load(f)['accuracy']['test'] <= 1.0
  table = compare.compare([str(sweep_dir)], str(tmp_path / 'cmp.png'))
  assert '| accuracy.test |' in table and os.path.getsize(tmp_path / 'cmp_intervals.png') > 5_000


def test_code_positions_study_smoke(tmp_path, study_data):
  """The position study on real code: RoPE, randomized RoPE (also at its training-style ids) and
  the RoPE reference trained at 4L, each evaluated at the same two lengths, then compared against
  RoPE (the labels name every field that differs, the derived Linformer length too)."""
  sweep_dir = tmp_path / 'code_positions'
  spec = _wrapped(tmp_path, 'rope_vs_alibi', study_data).replace(':quick', ':code,quick')
  _run(spec, sweep_dir, seeds=[0], run_eval=True)
  cells = sorted(os.listdir(sweep_dir))
  assert cells == ['data.max_length=256,model.position=rope,train.batch_size=8,seed=0',
                   'data.max_length=64,model.position=rope,model.random_positions_max=2048,seed=0',
                   'data.max_length=64,model.position=rope,seed=0'], cells
  for cell, names in ((cells[0], ['eval.json']),
                      (cells[1], ['eval.json', 'eval_position_ids=random.json'])):
    for name in names:
      with open(sweep_dir / cell / name) as f:
        rows = json.load(f)['extrapolation']
      windows = [row['length'] for row in rows if row['mode'] == 'non_overlapping']
      assert windows == [64, 128], (cell, name, windows)  # the same windows for all
  table = compare.compare([str(sweep_dir)], str(tmp_path / 'cmp.png'),
                          baseline='max_length=64,linformer_length=64,random_positions_max=0,'
                                   'batch_size=32')
  assert '[eval position_ids=random]' in table
  assert os.path.getsize(tmp_path / 'cmp_extrapolation.png') > 10_000


def test_code_postln_study_smoke(tmp_path, study_data):
  """Post-LN and Pre-LN at 6 layers without warmup on real code, compared with verdicts."""
  sweep_dir = tmp_path / 'code_postln'
  keep = ("(lambda sweep: dict(sweep, cells=[c for c in sweep['cells'] if c['model.num_layers'] "
          "== 6 and c['train.warmup_steps'] == 0]))")
  spec = _wrapped(tmp_path, 'postln_vs_preln', study_data, keep)
  _run(spec.replace(':quick', ':code,quick'), sweep_dir, seeds=[0])
  cells = sorted(os.listdir(sweep_dir))
  assert [c.split(',')[0] for c in cells] == ['model.norm_position=post',
                                              'model.norm_position=pre'], cells
  with open(sweep_dir / cells[0] / 'config.json') as f:
    assert json.load(f)['data']['task'] == 'python_code'
  compare.compare([str(sweep_dir)], str(tmp_path / 'cmp.png'), baseline='norm_position=pre')
  with open(tmp_path / 'cmp_stats.json') as f:
    assert json.load(f)['cells']['norm_position=post']['final_valid']['verdict'] == 'n/a'
