"""training.callbacks and the loop's use of them: callbacks run by phase (observe, then persist,
whatever the list order), see immutable records, and the loop applies the `Action`s they return."""

import dataclasses

import pytest

from training import callbacks
from training import checkpointing
from training import loop
from training import persist


class Recorder(callbacks.Callback):
  """Notes its name and the record's state when called; returns `action`."""

  def __init__(self, name, seen, action=None, phase=callbacks.OBSERVE):
    self.name, self.seen, self.action, self.phase = name, seen, action, phase

  def at_step(self, step, record):
    self.seen.append((self.name, record.state, record.stop))
    return self.action


def record(**fields):
  return callbacks.StepRecord(run=None, step=1, state='s0', log_sums={'steps': 0}, **fields)


def test_persist_callbacks_run_after_every_observe_one_whatever_the_list_order():
  seen = []
  save = Recorder('save', seen, phase=callbacks.PERSIST)
  a, b = Recorder('a', seen), Recorder('b', seen)
  ordered = callbacks.by_phase([save, a, b])
  assert ordered == [a, b, save]
  assert persist.Checkpointer.phase == callbacks.PERSIST
  loop._apply(record(), ordered, 'after_step', 1)
  assert [name for name, _, _ in seen] == ['a', 'b', 'save']


def test_an_unknown_phase_is_refused_naming_the_valid_ones():
  with pytest.raises(ValueError, match="phase 'later'; valid: observe, persist"):
    callbacks.by_phase([Recorder('x', [], phase='later')])


def test_each_callback_sees_the_actions_of_the_ones_before_it():
  seen = []
  first = record()
  cbs = [Recorder('redraw', seen, callbacks.Action(state='s1')),
         Recorder('log', seen, callbacks.Action(row={'loss': 1.5})),
         Recorder('hook', seen, callbacks.Action(stop=15)),
         Recorder('save', seen, callbacks.Action(stop=2), phase=callbacks.PERSIST)]
  out = loop._apply(first, callbacks.by_phase(cbs), 'after_step', 1)
  assert seen == [('redraw', 's0', 0), ('log', 's1', 0), ('hook', 's1', 0), ('save', 's1', 15)]
  assert (out.state, out.last, out.stop) == ('s1', {'loss': 1.5}, 15)  # the first stop asked
  assert int(out.log_sums['steps']) == 0 and set(out.log_sums) == set(loop.empty_log_sums())
  assert (first.state, first.last, first.log_sums) == ('s0', {}, {'steps': 0})  # unchanged
  with pytest.raises(dataclasses.FrozenInstanceError):
    out.state = 's2'


def test_a_failure_ends_the_run_before_the_callbacks_after_it():
  seen = []
  failure = checkpointing.SaveFailed('train: saving a checkpoint in d failed (x); stopping')
  cbs = [Recorder('a', seen, callbacks.Action(fail=failure)), Recorder('b', seen)]
  with pytest.raises(checkpointing.SaveFailed) as e:
    loop._apply(record(), cbs, 'after_step', 1)
  assert e.value is failure and [name for name, _, _ in seen] == ['a']


def test_a_plain_hook_gets_the_step_and_state_and_changes_nothing():
  calls = []
  hook = callbacks.Hook(lambda step, state: calls.append((step, state)))
  out = loop._apply(record(), [hook], 'after_step', 1)
  assert calls == [(1, 's0')] and out == record()
