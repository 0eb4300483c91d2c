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


def test_train_says_once_that_it_runs_on_the_cpu_unless_the_user_chose():
  """A GPU reachable without a known device node would otherwise train on the CPU silently."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_PLATFORMS'}
  probe = ('from training import host; host.cpu_when_no_accelerator(); '
           'print(host.cpu_notice("train"))')
  out = subprocess.run([sys.executable, '-c', probe], env=env, cwd=ROOT, capture_output=True,
                       text=True, check=True).stdout.strip()
  if host.accelerator_devices():
    assert out == 'None'
  else:
    assert out.startswith('train: running on the CPU (no device node /dev/nvidia[0-9]*')
    assert '/dev/dxg' in out and out.endswith('set JAX_PLATFORMS (e.g. cuda or tpu) to choose '
                                              'the backend yourself')
  chosen = subprocess.run([sys.executable, '-c', probe], env={**env, 'JAX_PLATFORMS': 'cpu'},
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
  assert chosen == 'None'  # the user's own JAX_PLATFORMS: nothing to say
