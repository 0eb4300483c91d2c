"""The library and the tools name no kernel, attention variant or position method: what each can do
is declared where it is defined (layers.contract.Kernel rows, Attention and Position class
attributes) and read everywhere else, so a string compared in training/ or tools/ is a missing
declaration. Also: the declarations that replaced such strings give what the names gave."""

import ast
import pathlib

import pytest
from flax import nnx

import models
from configs import default
from layers import attention
from layers import attention_variants
from layers import contract
from layers import positions
from models import accounting
from training import eval_checks
from training import evaluation
from training import validation

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = set(attention.KERNELS) | set(attention_variants.VARIANTS) | set(positions.POSITIONS)
# (file name, literal): why that file may spell the name. Keyed by the file's name, not its
# folder, so a tool moved into a package keeps its entry.
ALLOWED = {
    ('state.py', 'linear'): "train.schedule's linear decay, not the attention variant",
    ('legend.py', 'dense'): "the legend of model.moe_experts=0 (a dense FFN), not the variant",
    ('attention_tradeoff.py', 'dense'): 'the efficient-attention study: the reference rows '
                                        'benchmarks/attention_variants.py writes under that name',
    ('extrapolation.py', 'alibi'): "the position study's reference curve, a choice of "
                                           'that study (its ratio row), not a rule',
}


def _skipped(tree):
  """The ids of the string constants that are prose: docstrings and `help=` arguments."""
  skip = set()
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (
        body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
      skip.add(id(body[0].value))
    if isinstance(node, ast.Call):
      for keyword in node.keywords:
        if keyword.arg == 'help':
          skip.update(id(n) for n in ast.walk(keyword.value))
  return skip


def named_literals(root=ROOT):
  """['path:line: 'name''] for each string constant in training/*.py and tools/**/*.py that is a
  registered kernel, variant or position name and not allowed by `ALLOWED`."""
  files = sorted((root / 'training').glob('*.py')) + sorted((root / 'tools').rglob('*.py'))
  found = []
  for path in files:
    tree = ast.parse(path.read_text())
    skip = _skipped(tree)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
          and node.value in NAMES and (path.name, node.value) not in ALLOWED):
        found.append(f'{path.relative_to(root)}:{node.lineno}: {node.value!r}')
  return sorted(found)


def test_training_and_tools_name_no_kernel_variant_or_position():
  assert named_literals() == []


def test_the_allow_list_is_short_and_every_entry_is_used():
  assert len(ALLOWED) <= 4
  files = list((ROOT / 'training').glob('*.py')) + list((ROOT / 'tools').rglob('*.py'))
  used = set()
  for path in files:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Constant) and (path.name, node.value) in ALLOWED:
        used.add((path.name, node.value))
  assert used == set(ALLOWED)


def test_the_finder_sees_a_name_and_skips_prose(tmp_path):
  (tmp_path / 'training').mkdir()
  (tmp_path / 'tools' / 'pkg').mkdir(parents=True)
  (tmp_path / 'training' / 'a.py').write_text(
      '"""rope in a docstring."""\n'
      "def f(m):\n  '''ring too.'''\n  return m.position == 'rope'  # 'xla' in a comment\n")
  (tmp_path / 'tools' / 'pkg' / 'b.py').write_text(
      "flag('x', 'xla', help='one of xla, ring')\n")
  assert named_literals(tmp_path) == ["tools/pkg/b.py:1: 'xla'", "training/a.py:4: 'rope'"]


def test_a_kernel_that_needs_a_mesh_names_a_single_device_stand_in_that_takes_its_terms():
  for name, kernel in attention.KERNELS.items():
    assert bool(kernel.single_device) == (kernel.sequence_mesh == 'needed'), name
    if kernel.single_device:
      stand_in = attention.KERNELS[kernel.single_device]
      assert stand_in.sequence_mesh != 'needed' and not stand_in.missing(kernel.terms), name
      assert stand_in.dropout >= kernel.dropout, name
  default_kernel = attention.KERNELS[attention.DEFAULT_KERNEL]
  assert not default_kernel.missing(contract.TERMS) and default_kernel.dropout
  assert default.get_config().model.attention_impl == attention.DEFAULT_KERNEL


@pytest.mark.parametrize('name', sorted(positions.POSITIONS))
def test_a_position_declares_its_parameters_and_its_length_limit_as_it_builds(name):
  """`param_count` equals the parameters the method builds, and `max_positions` the rows of a
  learned table (None: any length), randomized positions included."""
  cfg = default.get_config().model
  cfg.update(position=name, d_model=16, num_heads=2, num_kv_heads=2, random_positions_max=48)
  method = positions.POSITIONS[name]
  assert method.param_count(cfg, 32) == accounting.position_params(cfg, 32)
  built = nnx.eval_shape(lambda: positions.make(cfg, 32, rngs=nnx.Rngs(0)))
  limit = method.max_positions(cfg, 32)
  if limit is None:
    built.check_length(1000)
  else:
    built.check_length(limit)
    with pytest.raises(ValueError):
      built.check_length(limit + 1)


def test_the_derived_lists_are_the_ones_the_names_gave():
  assert set(positions.RANDOM_POSITIONS) == {'rope', 'learned', 'sinusoidal'}
  assert {n for n, p in positions.POSITIONS.items() if p.eval_options} == {'rope', 'xpos'}
  assert {n for n, k in attention.KERNELS.items() if k.single_device} == {'ring'}


def _built(**model):
  cfg = default.get_config().model
  cfg.update(arch='decoder_only', num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, d_ff=32,
             **model)
  return cfg, models.build(cfg, 11, 16, rngs=nnx.Rngs(0))


def test_eval_options_reach_the_built_method_that_declares_them():
  """eval.py's --rope_scaling and --xpos_block as config overrides (`evaluation.eval_options`),
  applied by `positions.set_eval_options` to the method that declares the fields, and only
  there."""
  overrides = evaluation.eval_options('ntk:4', 0)
  assert overrides == {'--rope_scaling=ntk:4': {'rope_scaling': 'ntk', 'rope_scaling_factor': 4.0},
                       '--xpos_block=0': {'xpos_block': 0}}
  cfg, model = _built(position='rope')
  cfg.update(overrides['--rope_scaling=ntk:4'])
  positions.set_eval_options(model, cfg, ('rope_scaling', 'rope_scaling_factor'))
  assert (model.decoder.position.scaling, model.decoder.position.factor) == ('ntk', 4.0)
  with pytest.raises(ValueError, match='no position method that changes xpos_block'):
    positions.set_eval_options(model, cfg, ('xpos_block',))
  cfg, model = _built(position='xpos', xpos_block=4)
  cfg.xpos_block = 0
  positions.set_eval_options(model, cfg, ('xpos_block',))
  assert model.decoder.position.block == 0
  with pytest.raises(ValueError, match='no position method that changes rope_scaling'):
    positions.set_eval_options(model, cfg, ('rope_scaling', 'rope_scaling_factor'))


def test_an_eval_option_is_validated_as_a_changed_config(tmp_path, data_dir):
  config = default.get_config('quick')
  config.data.data_dir = str(data_dir)
  config.model.position = 'rope'
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  run = dict(split=['test'], translate=[], lengths=[], stream_split='test')
  eval_checks.check_eval_run(str(tmp_path), rope_scaling='yarn:4', **run)
  with pytest.raises(validation.ConfigError, match=r"^--rope_scaling=pi:0.5: model.rope_scaling_"
                                                   r'factor=0.5 must be >= 1'):
    eval_checks.check_eval_run(str(tmp_path), rope_scaling='pi:0.5', **run)
