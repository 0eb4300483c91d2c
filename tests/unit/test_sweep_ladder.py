"""Compute-matched ladders in sweep files (tools/sweep/spec.py, tools/sweep/ladder.py): expansion,
matched steps, the dry-run table and the one-line errors of a bad ladder."""

import io
import textwrap

import pytest

from models import accounting
from tests.helpers import tiny
from tools.sweep import ladder as sweep_ladder
from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec

SWEEP = '''
from configs import decoder_only

def get_config(arg=None):
  return decoder_only.get_config('quick')

def get_sweep():
  return {LADDER}
'''
LADDER = {'cells': [{'model.attention': 'dense'}, {'model.attention': 'mla'}],
          'seeds': [0, 1],
          'ladder': {'sizes': [{'model.d_model': 32, 'model.num_layers': 2},
                               {'model.d_model': 64, 'model.num_layers': 2}],
                     'flops': [2e11, 1e12]}}


def sweep_file(tmp_path, ladder):
  path = tmp_path / 'ladder_sweep.py'
  path.write_text(textwrap.dedent(SWEEP.replace('{LADDER}', repr(ladder))))
  return str(path)


def test_ladder_expands_to_variants_sizes_budgets_seeds_with_matched_steps(tmp_path):
  cells = sweep_spec.expand(LADDER)
  assert len(cells) == 2 * 2 * 2 * 2  # variants x sizes x budgets x seeds
  assert cells[0]['name'] == ('ladder.flops=200000000000.0,model.attention=dense,'
                              'model.d_model=32,model.num_layers=2,seed=0')
  assert len({c['name'] for c in cells}) == len(cells)
  module = sweep_spec.load_sweep_module(sweep_file(tmp_path, LADDER))
  for cell in cells:
    config = sweep_spec.cell_config(module, None, cell)
    spent = (config.train.steps * sweep_spec.tokens_per_step(config)
             * sweep_spec.flops_per_token(config))
    assert spent == pytest.approx(cell['overrides']['ladder.flops'], rel=0.05)
    cell['steps'] = config.train.steps
    argv = sweep_spec.train_command('s.py', '/sw', cell)
    assert f'--config.train.steps={config.train.steps}' in argv
    assert not any(a.startswith('--config.ladder') for a in argv)  # train.py has no such field


def test_dry_run_prints_the_table_and_warns_outside_1_to_1000_tokens_per_param(tmp_path):
  ladder = dict(LADDER, cells=[{}], seeds=[0], ladder=dict(LADDER['ladder'], flops=[1e9, 1e16]))
  out = io.StringIO()
  results = sweep_runner.run_sweep(sweep_file(tmp_path, ladder), str(tmp_path / 'sw'),
                                   dry_run=True, out=out)
  text = out.getvalue()
  assert set(results.values()) == {'dry_run'} and len(results) == 4
  assert '| cell | parameters | tokens | tokens/param | steps |' in text
  warnings = [line for line in text.splitlines() if line.startswith('warning:')]
  # 1e9 FLOPs is one step (under 1 token per parameter); 1e16 is thousands of tokens per param.
  assert len(warnings) == 4
  assert any('ladder.flops=1e+16' in w or 'ladder.flops=1e16' in w for w in warnings)


def test_index_names_each_cell_by_its_variant_size_and_budget():
  index = sweep_ladder.index(LADDER, sweep_spec.expand(LADDER))
  entry = index['ladder.flops=1000000000000.0,model.attention=mla,model.d_model=64,'
                'model.num_layers=2']
  assert entry == {'variant': 'model.attention=mla', 'size': 'model.d_model=64,model.num_layers=2',
                   'flops': 1e12}


@pytest.mark.parametrize('ladder, message', [
    ({'sizes': [{'model.d_model': 32}]}, "keys 'sizes' and 'flops'"),
    ({'sizes': [], 'flops': [1e12]}, "ladder['sizes'] must be a non-empty list"),
    ({'sizes': {'s': {}}, 'flops': [1e12]}, "ladder['sizes'] must be a non-empty list"),
    ({'sizes': [{'model.d_model': 32}, {'model.num_layers': 2}], 'flops': [1e12]},
     'the same fields'),
    ({'sizes': [{'model.d_model': 32}], 'flops': [0]}, "ladder['flops'] must be"),
    ({'sizes': [{'model.d_model': 32}], 'flops': '1e12'}, "ladder['flops'] must be"),
    ({'sizes': [{'train.steps': 5}], 'flops': [1e12]}, 'none of them train.steps'),
])
def test_bad_ladders_give_one_line_errors(ladder, message):
  with pytest.raises(sweep_spec.SweepError, match=message.replace('[', r'\[').replace(']', r'\]')
                     .replace('(', r'\(')) as e:
    sweep_spec.expand({'ladder': ladder})
  assert '\n' not in str(e.value)


def test_a_size_field_in_the_cells_too_is_refused():
  with pytest.raises(sweep_spec.SweepError, match='both in the ladder and in the cells'):
    sweep_spec.expand({'cells': [{'model.d_model': 64}],
                       'ladder': {'sizes': [{'model.d_model': 32}], 'flops': [1e12]}})


# --- Training FLOPs per token (models/accounting.py) ----------------------------------------------

def test_dense_decoder_is_6n_plus_attention():
  """Within 0.1% of 3 x (2 FLOPs per matmul weight + causal scores) of `forward_flops`, the
  independent count of the dense layer, and of 6N_nonembedding + 6·D·V + attention by hand."""
  config = tiny(64)
  m, v, t = config.model, 256, 64
  ours = accounting.training_flops_per_token(m, v, t)
  fl = accounting.forward_flops(m, v, t)
  assert ours == pytest.approx(3 * (fl['matmul'] + fl['scores_causal']) / t, rel=1e-3)
  layer = 4 * m.d_model ** 2 + 2 * m.d_model * m.d_ff  # relu/gelu FFN: 2·D·F, MHA: 4·D²
  by_hand = 6 * (layer * m.num_layers + m.d_model * v) + 3 * 4 * (t + 1) / 2 * m.d_model * (
      m.num_layers)
  assert ours == pytest.approx(by_hand, rel=0.02)


def test_moe_top1_of_4_costs_less_than_4_dense_ffns():
  dense4 = tiny(64, d_ff=4 * 256)  # the same FFN parameters as 4 experts of 256
  moe = tiny(64, moe_experts=4, moe_top_k=1, moe_d_ff=256)
  fpt = accounting.training_flops_per_token
  assert fpt(moe.model, 256, 64) < 0.6 * fpt(dense4.model, 256, 64)


@pytest.mark.parametrize('attention', ['mla', 'gated_deltanet'])
def test_a_variant_counts_its_own_projections(attention):
  dense = accounting.training_flops_per_token(tiny(64).model, 256, 64)
  other = accounting.training_flops_per_token(tiny(64, attention=attention).model, 256, 64)
  assert abs(other / dense - 1) > 0.01


def test_run_info_records_training_flops(tmp_path):
  from training import loop
  config = tiny(64)
  info = loop._write_run_info(config, str(tmp_path / 'run_info.json'), {'all': 1}, True, 256)
  fpt = accounting.training_flops_per_token(config.model, 256, 64)
  assert info['flops_per_token'] == fpt
  assert info['train_flops'] == fpt * config.train.batch_size * 64 * config.train.steps


def test_a_tuned_ladder_dry_run_prints_matched_steps_for_its_tuning_runs(tmp_path):
  one_rung = {'sizes': LADDER['ladder']['sizes'][:1], 'flops': [1e12]}
  ladder = dict(LADDER, cells=[{}], ladder=one_rung)
  out = io.StringIO()
  sweep_runner.run_sweep(sweep_file(tmp_path, ladder), str(tmp_path / 'sw'), dry_run=True,
                         tune='train.learning_rate:0.001,0.002', out=out)
  commands = [line for line in out.getvalue().splitlines() if line.startswith('python')]
  assert len(commands) == 2  # one tuning run a value; the other seed waits for them
  assert all('--config.train.steps=' in c for c in commands)


def test_named_sizes_name_the_index_and_expand_like_a_list():
  named = dict(LADDER, ladder={'sizes': {'s': LADDER['ladder']['sizes'][0],
                                         'm': LADDER['ladder']['sizes'][1]},
                               'flops': LADDER['ladder']['flops']})
  cells = sweep_spec.expand(named)
  assert [c['name'] for c in cells] == [c['name'] for c in sweep_spec.expand(LADDER)]
  assert sorted({e['size'] for e in sweep_ladder.index(named, cells).values()}) == ['m', 's']


def test_a_ladder_run_writes_its_index_and_trains_each_cell_at_its_matched_steps(tmp_path):
  import json
  import os
  ladder = dict(LADDER, seeds=[0])
  launched = {}

  def launch(argv, log_path, env):
    del log_path, env
    workdir = next(a for a in argv if a.startswith('--workdir=')).split('=', 1)[1]
    steps = int(next(a for a in argv if a.startswith('--config.train.steps=')).split('=')[1])
    launched[os.path.basename(workdir)] = steps
    os.makedirs(os.path.join(workdir, 'checkpoints', str(steps)))  # as train.py finishing would
    return 0

  sweep_dir = tmp_path / 'sw'
  results = sweep_runner.run_sweep(sweep_file(tmp_path, ladder), str(sweep_dir), launch=launch,
                                   out=io.StringIO())
  assert set(results.values()) == {'done'} and len(launched) == 8
  index = json.loads((sweep_dir / sweep_ladder.INDEX).read_text())
  assert set(index) == {n.rsplit(',seed=', 1)[0] for n in launched}
  # The larger size at the same budget trains fewer steps.
  small = launched['ladder.flops=1000000000000.0,model.attention=dense,model.d_model=32,'
                   'model.num_layers=2,seed=0']
  large = launched['ladder.flops=1000000000000.0,model.attention=dense,model.d_model=64,'
                   'model.num_layers=2,seed=0']
  assert large < small
