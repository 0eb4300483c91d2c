"""Sharded steps compiled for a TPU pod (v5p:2x2x2, 8 chips) by libtpu on this CPU host.

Nothing runs: libtpu's compiler, Mosaic included, checks that every kernel lowers and every
sharding partitions for the target, and reports the per-chip memory. A kernel that GSPMD cannot
partition, or a sharding rule that breaks on a TPU, fails here without a TPU.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import pytest

from training import aot

if not sys.platform.startswith('linux'):  # libtpu's wheels are Linux-only (the test extra's marker)
  pytest.skip('libtpu is published for Linux only', allow_module_level=True)

aot.quiet_libtpu()


import models  # noqa: E402
from configs import decoder_only  # noqa: E402
from configs import encoder_decoder  # noqa: E402
from configs import encoder_only  # noqa: E402
from layers import attention  # noqa: E402
from layers import attention_pallas  # noqa: E402
from tools import accounting  # noqa: E402
from training import validation  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPOLOGY = 'v5p:2x2x2'
ARCHS = {'decoder_only': decoder_only, 'encoder_decoder': encoder_decoder,
         'encoder_only': encoder_only}
MESHES = {'fsdp8': dict(fsdp=8), 'data2_fsdp2_tensor2': dict(data=2, fsdp=2, tensor=2)}
# Flash-attention layers per model of the quick configs (2 layers a stack): each is a Mosaic
# forward, dQ and dK/dV kernel in the train step and a forward kernel in the eval step.
ATTENTION_LAYERS = {'decoder_only': 2, 'encoder_decoder': 6, 'encoder_only': 2}


@pytest.fixture(scope='module')
def devices():
  return aot.topology_devices(TOPOLOGY)


def _config(arch, mesh, **fields):
  config = ARCHS[arch].get_config('quick')
  config.model.attention_impl = 'pallas'
  config.mesh.update(mesh)
  for field, value in fields.items():
    section, name = field.split('.')
    config[section][name] = value
  config = validation.resolve(config)
  with attention.compiling_for('tpu'):  # validated for the target, as tools.aot does
    validation.validate(config)
  return config


def _compile(config, devices, programs=('train', 'eval', 'decode')):
  return aot.compile_config(
      config, devices, vocab_size=accounting.task_vocab_size(config.data),
      special_ids=models.SpecialIds.from_tokenizer(accounting.toy_tokenizer()), programs=programs)


def _mosaic(report, program):
  return report[program]['custom_calls'].get('tpu_custom_call', 0)


@pytest.mark.parametrize('mesh', list(MESHES))
@pytest.mark.parametrize('arch', list(ARCHS))
def test_pallas_steps_compile_for_a_tpu_pod(arch, mesh, devices):
  report = _compile(_config(arch, MESHES[mesh]), devices)
  layers = ATTENTION_LAYERS[arch]
  assert _mosaic(report, 'train') == 3 * layers
  assert _mosaic(report, 'eval') == layers
  # The cached step attends one query row with the dense kernel: no Mosaic call.
  assert set(report) == ({'train', 'eval'} if arch == 'encoder_only' else
                         {'train', 'eval', 'decode'})
  if 'decode' in report:
    assert _mosaic(report, 'decode') == 0
  train = report['train']
  assert train['collectives']['all-gather'] > 0  # fsdp gathers the parameters it sharded
  if mesh == 'data2_fsdp2_tensor2':
    assert train['collectives']['all-reduce'] > 0  # tensor parallelism sums partial products
  for r in report.values():
    assert 0 < r['bytes']['total'] < aot.hbm_bytes(devices[0])
    assert r['flops'] > 0


@pytest.mark.parametrize('mesh', list(MESHES))
def test_splash_steps_compile_for_a_tpu_pod(mesh, devices):
  """jax's splash kernel per device under shard_map, GQA (4 heads, 2 KV heads: split over tensor 2
  on the second mesh): a Mosaic forward, dK/dV and dQ kernel per layer in the train step, a
  forward kernel in the eval step."""
  config = _config('decoder_only', MESHES[mesh], **{'model.attention_impl': 'splash',
                                                    'model.num_kv_heads': 2})
  report = _compile(config, devices, programs=('train', 'eval'))
  layers = ATTENTION_LAYERS['decoder_only']
  assert _mosaic(report, 'train') == 3 * layers
  assert _mosaic(report, 'eval') == layers
  for r in report.values():
    assert 0 < r['bytes']['total'] < aot.hbm_bytes(devices[0])


def test_splash_train_step_flops_count_its_kernels(devices):
  """splash's calls carry cost estimates (`layers.attention_splash_cost`): XLA's FLOPs of the train
  step at 2,048 tokens agree with the closed form within 10%, as pallas's do (without them XLA
  counted the rest of the step alone, 0.28 of it for the default model)."""
  config = _config('decoder_only', MESHES['fsdp8'], **{
      'model.attention_impl': 'splash', 'data.max_length': 2048, 'data.packing': 'stream'})
  train = _compile(config, devices, programs=('train',))['train']
  analytic = aot.analytic_flops(config, accounting.task_vocab_size(config.data), len(devices),
                                'tpu')
  assert abs(train['flops'] / analytic - 1) < 0.1, (train['flops'], analytic)


def test_scanned_train_step_flops_count_every_layer(devices):
  """libtpu's cost analysis counts a while body once: a scanned stack of 4 layers (forward and
  backward loops) read as about one layer. Counted by their trip counts (training.hlo_cost), the
  scanned step's FLOPs are within 10% of the unrolled step's and of the closed form, and full
  remat's recomputed forward adds to them."""
  fields = {'model.attention_impl': 'xla', 'model.num_layers': 4}
  scanned, unrolled, remat = (
      _compile(_config('decoder_only', MESHES['fsdp8'], **fields, **more), devices,
               programs=('train',))['train']
      for more in ({'model.scan_layers': True}, {'model.scan_layers': False},
                   {'model.scan_layers': True, 'model.remat': 'full'}))
  config = _config('decoder_only', MESHES['fsdp8'], **fields)
  analytic = aot.analytic_flops(config, accounting.task_vocab_size(config.data), len(devices),
                                'tpu')
  assert scanned['loops_counted'] and sorted(scanned['loops'].values()) == [4, 4]
  assert scanned['flops_counted_once'] < 0.5 * unrolled['flops']
  assert abs(scanned['flops'] / unrolled['flops'] - 1) < 0.1, (scanned, unrolled)
  assert abs(scanned['flops'] / analytic - 1) < 0.1, (scanned['flops'], analytic)
  assert scanned['estimate']['compute_s'] > 0.9 * unrolled['estimate']['compute_s']
  # Full remat: the backward loop recomputes each layer's forward, counted 4 times too.
  assert remat['loops_counted'] and sorted(remat['loops'].values()) == [4, 4]
  assert remat['flops'] > 1.1 * scanned['flops']


def test_compiling_leaves_no_tpu_cluster_variables_behind(devices):
  """libtpu's start-up settings would make every later train.py subprocess join a TPU pod."""
  del devices
  assert 'TPU_WORKER_HOSTNAMES' not in os.environ
  assert 'TPU_ACCELERATOR_TYPE' not in os.environ


def test_pallas_without_shard_map_does_not_compile_on_a_mesh(devices, monkeypatch):
  """The reason the kernels run under shard_map: GSPMD refuses to partition a Mosaic call."""
  monkeypatch.setitem(attention.KERNELS, 'pallas', dataclasses.replace(
      attention.KERNELS['pallas'], fn=attention_pallas.attention))
  with pytest.raises(Exception, match='Mosaic kernels cannot be automatically partitioned'):
    _compile(_config('decoder_only', MESHES['fsdp8']), devices, programs=('train',))


def test_ring_attention_compiles_on_a_sequence_mesh(devices):
  config = _config('decoder_only', dict(data=2, sequence=4), **{'model.attention_impl': 'ring',
                                                                 'model.position': 'rope'})
  report = _compile(config, devices, programs=('train',))
  # Key/value blocks travel round the ring: forward, then again in the backward pass.
  assert report['train']['collectives']['collective-permute'] > 0
  assert _mosaic(report, 'train') == 0


def test_bf16_scanned_layers_and_gradient_accumulation_compile(devices):
  config = _config('decoder_only', MESHES['data2_fsdp2_tensor2'],
                   **{'train.compute_dtype': 'bfloat16', 'model.scan_layers': True,
                      'train.grad_accum_steps': 2, 'train.batch_size': 16})
  # Under the float32 tests' global 'highest' the bfloat16 tiles still compile (Mosaic has no
  # fp32-contract bfloat16 matmul).
  with jax.default_matmul_precision('highest'):
    report = _compile(config, devices)
  # One scanned block (3 kernels) inside the micro-batch scan: the kernels appear once.
  assert _mosaic(report, 'train') == 3
  assert _mosaic(report, 'eval') == 1
  assert report['decode']['bytes']['alias'] > 0  # the cache is donated and updated in place


def test_a_registered_architecture_compiles_from_its_declaration(devices, monkeypatch):
  """The prefix LM of tests/unit/test_open_architecture.py, registered with one dict entry: its
  train, eval and cached decode steps compile for the pod from what it declares."""
  from tests.unit import test_open_architecture as open_arch
  monkeypatch.setitem(models.ARCHS, 'prefix_lm', open_arch.PrefixLM)
  config = decoder_only.get_config('quick')
  config.model.update(arch='prefix_lm', position='rope')
  config.model.prefix_length = 8
  config.mesh.update(MESHES['fsdp8'])
  config = validation.resolve(config)
  validation.validate(config)
  report = _compile(config, devices)
  assert set(report) == {'train', 'eval', 'decode'}  # it declares a decoding stack
  assert report['train']['collectives']['all-gather'] > 0
  for r in report.values():
    assert 0 < r['bytes']['total'] < aot.hbm_bytes(devices[0])
  assert aot.analytic_flops(config, accounting.task_vocab_size(config.data), 8) > 0


def _aot(*args):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  return subprocess.run([sys.executable, '-m', 'tools.aot', *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)


def test_cli_reports_a_fitting_pallas_config_as_json():
  r = _aot(f'--topology={TOPOLOGY}', '--config=configs/decoder_only.py',
           '--config.model.attention_impl=pallas', '--config.mesh.fsdp=8', '--json')
  assert r.returncode == 0, r.stderr
  summary = json.loads(r.stdout.strip().splitlines()[-1])
  assert summary['fits'] is True and summary['chips'] == 8
  assert summary['hbm_bytes'] == 95 * 2 ** 30
  assert 0 < summary['per_chip_bytes'] < summary['hbm_bytes']
  assert summary['custom_calls']['tpu_custom_call'] >= 1
  assert summary['mesh'] == {'data': 1, 'fsdp': 8, 'tensor': 1, 'sequence': 1, 'expert': 1}
  assert set(summary['collectives']) == set(aot.COLLECTIVES)
  # XLA's count of the train step and the closed form agree within 10% (the Mosaic kernels'
  # FLOPs, about 4·T²·D per layer here, are left out of XLA's).
  assert abs(summary['flops_per_chip'] / summary['analytic_flops_per_chip'] - 1) < 0.1
  assert 'could not determine TPU' not in r.stderr + r.stdout  # libtpu's noise kept out
  # The roofline estimate of the train step: its terms, the largest as the bound, and the MFU.
  e = summary['estimate']
  terms = {b: e[b + '_s'] for b in ('compute', 'memory', 'collective')}
  assert all(t > 0 for t in terms.values()) and e['collective_bytes'] > 0  # fsdp gathers
  assert e['bound'] == max(terms, key=terms.get) and e['step_s'] == max(terms.values())
  assert 0 < e['mfu'] <= 1 and e['compiler_s'] > 0
  assert 'Estimated train step (from the compiled program, not a measurement)' in r.stdout


def test_cli_mesh_search_ranks_every_mesh_of_the_chips():
  r = _aot('--topology=v5e:2x2', '--config=configs/decoder_only.py:quick', '--mesh=search',
           '--programs=train', '--json')
  assert r.returncode == 0, r.stderr
  meshes = json.loads(r.stdout.strip().splitlines()[-1])['meshes']
  # data x fsdp x tensor = 4: six meshes, each compiled or refused with its reason.
  assert sorted(tuple(m['mesh'][a] for a in ('data', 'fsdp', 'tensor')) for m in meshes) == [
      (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)]
  ranked = [m for m in meshes if not m.get('error')]
  assert ranked and all(m['estimate'] for m in ranked)
  steps = [m['estimate']['step_s'] for m in ranked]
  assert steps == sorted(steps) and meshes[:len(ranked)] == ranked  # the losers after
  assert '| 1 |' in r.stdout and "x the first's step, bound by" in r.stdout


def test_cli_refuses_a_config_too_large_for_the_chip():
  r = _aot('--topology=v5e:2x2', '--config=configs/decoder_only.py:quick',
           '--config.data.max_length=8192', '--config.model.d_model=128',
           '--config.model.num_heads=8', '--config.mesh.fsdp=4', '--config.train.batch_size=16',
           '--programs=train')
  assert r.returncode == 1, r.stderr
  line = r.stderr.strip().splitlines()[-1]
  # libtpu's compiler refuses, naming the temporaries alone: a lower bound of the need.
  assert line.startswith('aot: needs at least ') and line.endswith('GiB per chip, v5e has 16'), line
  assert float(line.split()[4]) > 16


@pytest.mark.parametrize('args,message', [
    (['--topology=v9z:2x2'], 'is not a TPU topology libtpu knows'),
    (['--topology=v5p:2x2x2', '--config.mesh.fsdp=4'], 'must equal the device count 8'),
    (['--topology=v5p:2x2x2', '--config.model.num_heads=7'], 'must divide model.d_model'),
    # Validated for the TPU target (splash passes the platform check), refused for ALiBi.
    (['--topology=v5p:2x2x2', '--config.mesh.fsdp=8', '--config.model.attention_impl=splash',
      '--config.model.position=alibi'], "which model.attention_impl='splash' cannot take"),
])
def test_cli_bad_input_is_one_line_with_exit_2(args, message):
  r = _aot('--config=configs/decoder_only.py:quick', *args)
  assert r.returncode == 2, r.stderr
  lines = r.stderr.strip().splitlines()
  assert len(lines) == 1 and message in lines[0], r.stderr
  if 'v9z' in args[0]:
    assert 'v5p:2x2x2' in lines[0]  # valid examples named


def test_missing_libtpu_names_the_install_command(monkeypatch):
  monkeypatch.setitem(sys.modules, 'libtpu', None)  # `import libtpu` raises ImportError
  with pytest.raises(aot.AotError, match=r'pip install "jax\[tpu\]=='):
    aot.topology_devices(TOPOLOGY)


def test_cli_compiles_every_cell_of_a_sweep(tmp_path):
  sweep = tmp_path / 'grid.py'
  sweep.write_text(
      'from configs import decoder_only\n'
      'def get_config(arg=None):\n'
      '  config = decoder_only.get_config("quick")\n'
      '  config.mesh.fsdp = 8\n'
      '  return config\n'
      'def get_sweep():\n'
      '  return {"cells": [{"model.attention_impl": "pallas"}, {"model.attention_impl": "xla"},\n'
      '                    {"model.num_kv_heads": 3}], "seeds": [0, 1]}\n')
  r = _aot(f'--topology={TOPOLOGY}', f'--sweep={sweep}', '--programs=train', '--json')
  assert r.returncode == 2, r.stderr  # the third cell is a config error
  cells = json.loads(r.stdout.strip().splitlines()[-1])['cells']
  assert len(cells) == 3  # one seed per cell: the seed does not change the program
  assert cells['model.attention_impl=pallas']['custom_calls']['tpu_custom_call'] == 6
  assert 'tpu_custom_call' not in cells['model.attention_impl=xla']['custom_calls']
  assert cells['model.num_kv_heads=3']['status'] == 2
  assert '| model.attention_impl=pallas | fsdp 8 |' in r.stdout


def test_dropless_expert_parallel_moe_compiles_with_megablox(devices):
  """Dropless token choice on expert 4 x fsdp 2: per device under shard_map, the tokens travel
  by ragged all-to-all and each device's experts run as megablox grouped matmuls (Mosaic)."""
  config = _config('decoder_only', dict(expert=4, fsdp=2), **{
      'model.attention_impl': 'xla', 'model.moe_experts': 8, 'model.moe_top_k': 2,
      'model.moe_capacity_factor': 0.0})
  train = _compile(config, devices, programs=('train',))['train']
  # 2 MoE layers, each 2 grouped matmuls forward and 4 backward (megablox's gmm and tgmm).
  assert _mosaic({'train': train}, 'train') == 12
  assert train['collectives']['all-to-all'] > 0  # there and back, forward and backward
  assert 0 < train['bytes']['total'] < aot.hbm_bytes(devices[0])


def test_a_receive_buffer_brings_dropless_moe_to_the_capacity_steps_cost(devices):
  """Dropless with `moe_buffer_factor` 1.25 against capacity 1.25 on expert 4 x fsdp 2: XLA's
  FLOPs within 1.3x and the memory within 1.5x (the worst-case buffer: 2.2x the FLOPs here)."""
  moe = {'model.attention_impl': 'xla', 'model.moe_experts': 8, 'model.moe_top_k': 2}
  mesh = dict(expert=4, fsdp=2)
  capacity = _compile(_config('decoder_only', mesh, **moe, **{
      'model.moe_capacity_factor': 1.25}), devices, programs=('train',))['train']
  buffered = _compile(_config('decoder_only', mesh, **moe, **{
      'model.moe_buffer_factor': 1.25}), devices, programs=('train',))['train']
  assert _mosaic({'train': buffered}, 'train') == 12  # still megablox, under shard_map
  assert buffered['flops'] <= 1.3 * capacity['flops']
  assert buffered['bytes']['total'] <= 1.5 * capacity['bytes']['total']
