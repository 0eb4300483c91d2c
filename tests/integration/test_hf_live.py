"""The parity checks live against transformers (opt-in: `pytest -m hf_live`; skipped where
transformers and torch are not installed, as in CI, whose fixtures stand in for them)."""

import os

import numpy as np
import pytest

from tools.hf import convert
from tools.hf import export

transformers = pytest.importorskip('transformers')
torch = pytest.importorskip('torch')
pytestmark = pytest.mark.hf_live

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'fixtures', 'hf')
CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))


def _theirs(folder, ids):
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.from_numpy(np.asarray(ids, np.int64))[None]).logits[0].numpy()


@pytest.mark.parametrize('case', CASES)
def test_export_loads_in_transformers_with_equal_logits(case, tmp_path):
  """Import a fixture, export it, load the export with transformers: the same family's class and
  logits equal to attnlab's and to the fixture's own model."""
  workdir, out = str(tmp_path / 'wd'), str(tmp_path / 'out')
  convert.import_checkpoint(os.path.join(FIXTURES, case), workdir, log=lambda *_: None)
  export.export_checkpoint(workdir, out, log=lambda *_: None)
  ids = np.load(os.path.join(FIXTURES, case, 'expected.npz'))['ids']
  ours = export.logits(workdir, ids)
  np.testing.assert_allclose(_theirs(out, ids), ours, atol=1e-4, rtol=0)
  np.testing.assert_allclose(_theirs(os.path.join(FIXTURES, case), ids), ours, atol=1e-4, rtol=0)
