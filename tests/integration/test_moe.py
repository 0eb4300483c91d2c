"""MoE training at scale of the toy: expert parallelism equals one device, and the auxiliary-loss-
free bias survives a SIGKILL."""

import os
import signal
import subprocess
import sys
import time

import json

from flax import nnx
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from layers import sharding
from models import accounting
from tests.helpers import ROOT, metric_rows, quick_config
from tests.integration.test_sharding import assert_same_run
from training import loop
from training import validation

MOE = dict(moe_experts=4, moe_top_k=2)


def run(data_dir, workdir, mesh=None, **model):
  config = quick_config(data_dir, steps=20, log_every=1, eval_every=100, checkpoint_every=100)
  config.data.shards = 2
  config.mesh.update(mesh or {})
  config.model.update(**MOE, **model)
  validation.validate(config)
  loop.train_and_evaluate(config, str(workdir))
  return np.asarray([r['loss'] for r in metric_rows(workdir)])


@pytest.mark.parametrize('capacity,mesh', [
    (1.25, dict(data=2, expert=4)),  # dispatch by capacity: all-to-all over the expert axis
    (0.0, dict(data=2, fsdp=2, expert=2)),  # dropless (ragged_dot)
], ids=['capacity-expert4', 'dropless-expert2xfsdp2'])
def test_expert_parallel_training_equals_one_device(data_dir, tmp_path, capacity, mesh):
  """The 8 simulated devices as expert 4 (x data 2), or expert 2 x fsdp 2 (x data 2): each
  device holds E / mesh.expert experts, and the 20 losses are the one-device run's."""
  one = run(data_dir, tmp_path / 'one', moe_capacity_factor=capacity)
  sharded = run(data_dir, tmp_path / 'mesh', mesh, moe_capacity_factor=capacity)
  assert sharded[-1] < sharded[0]
  assert_same_run(sharded, one)
  # The experts are split: each stacked expert weight's first axis over `expert` (and its model
  # dimension over fsdp where there is one).
  config = ml_collections.ConfigDict(json.loads((tmp_path / 'mesh' / 'config.json').read_text()))
  model = accounting.abstract_model(config.model, 40, config.data.max_length)
  specs = sharding.param_specs(nnx.state(model, nnx.Param), accounting.abstract_mesh(config.mesh),
                               sharding.rules_of(config.mesh))
  experts = {'/'.join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(specs)
             if p[-1] in ('wi', 'wo')}
  assert len(experts) == 2 * config.model.num_layers
  fsdp = 'fsdp' if mesh.get('fsdp', 1) > 1 else None
  for path, spec in experts.items():
    assert spec[0] == 'expert' and fsdp in tuple(spec), (path, spec)


def test_router_bias_survives_sigkill_and_resume(data_dir, tmp_path):
  """Auxiliary-loss-free balancing: killed (SIGKILL) after its checkpoint at step 10, the rerun
  restores the experts' biases with the rest of the state, and every metrics row (loss, load
  coefficient of variation, aux and z terms) equals the uninterrupted run's."""
  overrides = dict(moe_experts=4, moe_top_k=1, moe_aux_loss=0.0, moe_bias_rate=0.01)
  flags = [f'--config.model.{k}={v}' for k, v in overrides.items()]
  base = [sys.executable, os.path.join(ROOT, 'train.py'),
          '--config=' + os.path.join(ROOT, 'configs/decoder_only.py:quick'),
          f'--config.data.data_dir={data_dir}', '--config.train.steps=16',
          '--config.train.checkpoint_every=5', '--config.train.log_every=1',
          '--config.train.eval_every=100', *flags]
  killed = tmp_path / 'killed'
  proc = subprocess.Popen(base + [f'--workdir={killed}'], cwd=ROOT, stderr=subprocess.DEVNULL)
  ckpt = killed / 'checkpoints'
  deadline = time.time() + 120
  while time.time() < deadline and proc.poll() is None:
    if ckpt.exists() and any(p.isdigit() and int(p) >= 10 for p in os.listdir(ckpt)):
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.05)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, 'run finished before it could be killed'
  saved = ocp.PyTreeCheckpointer().restore(str(ckpt / '10' / 'state'))['buffers']
  biases = [np.asarray(b) for b in jax.tree.leaves(saved)]
  assert len(biases) == 2 and all(np.any(b != 0) for b in biases)  # it moved, and is saved
  subprocess.run(base + [f'--workdir={killed}'], cwd=ROOT, check=True, stderr=subprocess.DEVNULL)
  config = quick_config(data_dir, steps=16, checkpoint_every=5, log_every=1, eval_every=100)
  config.model.update(overrides)
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path / 'clean'))
  keys = ('step', 'loss', 'moe_load_cv', 'moe_aux_loss', 'moe_z_loss', 'moe_drop_fraction')
  rows = [{k: r[k] for k in keys} for r in metric_rows(killed)]
  clean = [{k: r[k] for k in keys} for r in metric_rows(tmp_path / 'clean')]
  assert [r['step'] for r in rows] == list(range(1, 17))
  assert rows == clean
