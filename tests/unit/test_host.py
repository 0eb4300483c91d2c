"""Host set-up before JAX starts: the CPU backend where no accelerator device exists."""

import os
import subprocess
import sys

from tests.helpers import ROOT
from training import host


def test_tools_choose_the_cpu_before_jax_starts_on_a_host_without_an_accelerator():
  """An installed libtpu would otherwise probe for a TPU in every tool (five lines of errors)."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  out = subprocess.run([sys.executable, '-c', 'import os, tools; '
                        'print(os.environ.get("JAX_PLATFORMS"))'], env=env, cwd=ROOT,
                       capture_output=True, text=True, check=True)
  assert out.stdout.strip() == ('None' if host.accelerator_devices() else 'cpu')
