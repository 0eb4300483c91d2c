"""training.supervisor without processes: which command lines it supervises, and the one line it
makes of a child's native log (the texts are XLA's, as a lost process leaves them)."""

import signal

import pytest

from training import supervisor

ARGV = ['train.py', '--workdir=/w', '--coordinator_address=h:1', '--num_processes=2',
        '--process_id', '1', '--heartbeat_timeout=7']
JOINED = {'joined': True, 'good': 8}


@pytest.mark.parametrize('argv,environ,multi', [
    (['train.py', '--workdir=/w'], {}, False),
    (['train.py', '--num_processes=2'], {}, True),
    (['train.py', '--multihost'], {}, True),
    (['train.py', '--nomultihost'], {}, False),
    (['train.py'], {'SLURM_STEP_NUM_TASKS': '4'}, True),
    (['train.py'], {'SLURM_STEP_NUM_TASKS': '1'}, False),
])
def test_multi_process_command_lines(argv, environ, multi):
  assert supervisor.multi_process(argv, environ) is multi


def test_flag_values_as_absl_reads_them():
  assert supervisor.flag_value(ARGV, 'process_id') == '1'
  assert supervisor.flag_value(ARGV, 'heartbeat_timeout') == '7'
  assert supervisor.flag_value(ARGV, 'init_timeout', 300) == 300


def test_a_peer_without_heartbeats_is_named():
  text = ('E1204 coordination_service.cc:1549] Use error polling to propagate the following error '
          'to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending '
          'heartbeats):\n1\nThe tasks have crashed.')
  line, code = supervisor.report('train', ARGV, text, JOINED, -signal.SIGABRT, '/w/logs/p.log')
  assert code == supervisor.LOST_PROCESS_EXIT == 75
  assert line.startswith('train: process 1 of 2 was lost (no heartbeat for 7 s, '
                         '--heartbeat_timeout); the newest checkpoint is step 8; rerun the same '
                         'command on every host (python train.py --workdir=/w ')
  assert line.endswith('); details in /w/logs/p.log') and '\n' not in line


def test_the_lost_coordinator_is_named_with_its_address():
  text = ('UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was '
          'preempted/died/restarted unexpectedly')
  line, code = supervisor.report('train', ARGV, text, {'joined': True, 'good': None}, -6, 'L')
  assert code == 75
  assert line.startswith('train: process 0 of 2, the coordinator at h:1, was lost (it stopped '
                         'answering); no checkpoint was saved yet; rerun')


def test_a_run_that_never_joined_names_the_wait():
  line, code = supervisor.report('train', ARGV, 'DEADLINE_EXCEEDED RegisterTask',
                                 {'joined': False, 'good': None}, -6, 'L')
  assert code == 75
  assert line == ('train: not every process of 2 joined the run at h:1 within 300 s '
                  '(--init_timeout); start the same command on every host; details in L')


def test_another_end_keeps_its_signal():
  line, code = supervisor.report('train', ARGV, 'nothing known', JOINED, -signal.SIGSEGV, 'L')
  assert code == 128 + signal.SIGSEGV
  assert line.startswith('train: this process ended by SIGSEGV; the newest checkpoint is step 8')
