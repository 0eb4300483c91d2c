"""A process of a multi-process run that dies (SIGKILL: a preempted or dead VM), or never joins:
the others stop within the heartbeat timeout with one line and exit 75, no C++ trace on the
terminal, and the rerun resumes to the uninterrupted run's rows, with the same or another process
count. The set-up is test_sharding's: local processes of 4 CPU devices joined over gloo."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import ROOT, metric_rows, quick_config
from tests.integration.test_sharding import assert_same_run, free_port
from training import loop
from training import supervisor
from training import validation

STEPS, EVERY, HEARTBEAT = 16, 4, 5


def flags(data_dir, workdir):
  return ['--config=configs/decoder_only.py:quick', f'--workdir={workdir}',
          f'--config.data.data_dir={data_dir}', f'--config.train.steps={STEPS}',
          '--config.train.log_every=1', '--config.train.eval_every=1000',
          f'--config.train.checkpoint_every={EVERY}', '--config.mesh.fsdp=8',
          '--config.data.shards=2', f'--heartbeat_timeout={HEARTBEAT}']


def start(args, num_processes, devices, ids=None):
  """train.py as `num_processes` local processes of `devices` CPU devices (only those of `ids`
  started), joined on loopback."""
  env = {**os.environ, 'XLA_FLAGS': f'--xla_force_host_platform_device_count={devices}',
         'JAX_PLATFORMS': 'cpu'}
  common = [sys.executable, 'train.py', *args]
  if num_processes > 1:
    common += [f'--coordinator_address=localhost:{free_port()}', f'--num_processes={num_processes}']
  ids = range(num_processes) if ids is None else ids
  return [subprocess.Popen(common + ([f'--process_id={i}'] if num_processes > 1 else []), cwd=ROOT,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for i in ids]


def finish(procs, timeout=240):
  outputs = [p.communicate(timeout=timeout) for p in procs]
  assert all(p.returncode == 0 for p in procs), '\n'.join(e[-3000:] for _, e in outputs)


def wait_for(workdir, moment, deadline=180):
  """Until the run is training past step 6 ('training') or writing a checkpoint ('saving')."""
  end = time.time() + deadline
  while time.time() < end:
    if moment == 'saving':
      names = os.listdir(workdir / 'checkpoints') if (workdir / 'checkpoints').is_dir() else []
      if any('tmp' in n for n in names):  # a checkpoint being written
        return
    else:
      try:
        if max((json.loads(l)['step'] for l in open(workdir / 'metrics.jsonl')), default=0) >= 6:
          return
      except (OSError, ValueError):
        pass
    time.sleep(0.01)
  raise AssertionError(f'the run never reached {moment}')


@pytest.fixture(scope='module')
def uninterrupted(data_dir, tmp_path_factory):
  """The rows of the same run, uninterrupted, in one process over the same 8-device mesh."""
  workdir = tmp_path_factory.mktemp('full')
  config = quick_config(data_dir, steps=STEPS, log_every=1, eval_every=1000,
                        checkpoint_every=EVERY)
  config.mesh.fsdp, config.data.shards = 8, 2
  validation.validate(config)
  loop.train_and_evaluate(config, str(workdir))
  return metric_rows(workdir)


def assert_one_line(err, pattern):
  """The survivor's stderr ends in one line matching `pattern`, with no trace of any kind."""
  for noise in ('Traceback', 'Check failure', 'Fatal Python', 'coordination', 'Gloo'):
    assert noise not in err, err[-3000:]
  assert not re.search(r'^[EFW]\d{4} ', err, re.M), err[-3000:]  # no C++ log line
  last = err.strip().splitlines()[-1]
  assert re.fullmatch(pattern, last), err[-3000:]
  return last


# Each way of failing once in CI (a worker lost, found by its missing heartbeats, while it saves;
# the coordinator lost while training); the other two pairings are `slow`.
@pytest.mark.parametrize('victim,moment', [
    (1, 'saving'), (0, 'training'), pytest.param(1, 'training', marks=pytest.mark.slow),
    pytest.param(0, 'saving', marks=pytest.mark.slow)])
def test_a_lost_process_stops_the_other_in_one_line_and_the_rerun_resumes(
    data_dir, tmp_path, uninterrupted, victim, moment):
  args = flags(data_dir, tmp_path)
  procs = start(args, 2, 4)
  wait_for(tmp_path, moment)
  procs[victim].send_signal(signal.SIGKILL)  # its train.py child dies with it
  killed = time.time()
  survivor = procs[1 - victim]
  _, err = survivor.communicate(timeout=120)
  took = time.time() - killed
  procs[victim].wait()
  assert survivor.returncode == supervisor.LOST_PROCESS_EXIT, err[-3000:]
  # Process 0 learns of process 1 from the missing heartbeats; process 1 of process 0 at once.
  assert took < (HEARTBEAT + 10 if victim == 1 else 10), took
  who = (f'process 1 of 2 was lost \\(no heartbeat for {HEARTBEAT} s, --heartbeat_timeout\\)'
         if victim == 1 else
         r'process 0 of 2, the coordinator at localhost:\d+, was lost \(it stopped answering\)')
  assert_one_line(err, rf'train: {who}; (the newest checkpoint is step \d+|no checkpoint was saved '
                  rf'yet); rerun the same command on every host \(python train.py .*'
                  rf'--process_id={1 - victim}\); details in .*process-{1 - victim}\.log')
  assert os.path.getsize(tmp_path / 'logs' / f'process-{1 - victim}.log') > 0
  # The same command on every host, or (the coordinator's host lost) one process of 8 devices.
  finish(start(args, 2, 4) if victim == 1 else start(args, 1, 8))
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == list(range(1, STEPS + 1))
  assert_same_run(np.asarray([r['loss'] for r in rows]),
                  np.asarray([r['loss'] for r in uninterrupted]))


def test_a_process_that_never_joins_is_named_with_the_wait(data_dir, tmp_path):
  (proc,) = start(flags(data_dir, tmp_path) + ['--init_timeout=5'], 2, 4, ids=[0])
  began = time.time()
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == supervisor.LOST_PROCESS_EXIT, err[-3000:]
  assert time.time() - began < 40
  assert_one_line(err, r'train: not every process of 2 joined the run at localhost:\d+ within 5 s '
                  r'\(--init_timeout\); start the same command on every host; details in .*')
