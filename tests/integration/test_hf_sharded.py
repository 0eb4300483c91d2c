"""`python -m tools.hf import --mesh=...` on 4 host devices: each tensor is placed on its sharding
as it is read (parameters split over fsdp and tensor, not replicated), and the sharded model's
logits equal transformers' as on one device."""

import os
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = r'''
import sys
import numpy as np
from flax import nnx
from tools.hf import convert, export
fixture, workdir = sys.argv[1], sys.argv[2]
convert.import_checkpoint(fixture, workdir, mesh={'fsdp': 2, 'tensor': 2}, log=lambda *_: None)
_, model, _ = export.load(workdir)
leaves, _ = convert.param_paths(nnx.state(model, nnx.Param))
split = {path: leaf.sharding.shard_shape(leaf.shape) != leaf.shape for path, leaf in leaves}
devices = {len(leaf.sharding.device_set) for _, leaf in leaves}
want = np.load(fixture + '/expected.npz')
logits = np.asarray(model({'inputs': want['ids'][None].astype(np.int32)}))[0]
print('devices=', sorted(devices))
print('split=', sum(split.values()), 'of', len(split))
print('embedding split=', split[('decoder', 'embed', 'embedding')])
print('query split=', split[('decoder', 'blocks', 0, 'self_attention', 'query', 'kernel')])
print('error=', float(np.abs(logits - want['logits']).max()))
'''


def test_import_places_every_tensor_on_its_sharding(tmp_path):
  env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=4',
         'JAX_PLATFORMS': 'cpu'}
  fixture = os.path.join(ROOT, 'tests', 'fixtures', 'hf', 'qwen2')
  out = subprocess.run([sys.executable, '-c', SCRIPT, fixture, str(tmp_path / 'wd')], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(line.split('= ', 1) for line in out.stdout.strip().splitlines() if '= ' in line)
  assert lines['devices'] == '[4]', out.stdout
  assert lines['embedding split'] == 'True' and lines['query split'] == 'True', out.stdout
  split, _, total = lines['split'].partition(' of ')
  assert int(split) >= int(total) // 2, out.stdout  # the norms' scales and biases may replicate
  assert float(lines['error']) < 1e-5, out.stdout
