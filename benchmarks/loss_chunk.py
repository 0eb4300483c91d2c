"""Compiled temp memory and step time of the train step, plain loss vs `train.loss_chunk`.

    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=-reduce \
      .venv/bin/python benchmarks/loss_chunk.py [--chunks=2048,4096,8192] [--rounds=5] [--steps=1] \
      [--attention_impl=xla|blockwise] [--json]

A decoder-only model (2 layers, D=256, N=4, F=1024, float32, AdamW, diagnostics off) with a large
vocabulary, V = 32,768, T = 1,024, B = 4: the `[B, T, V]` float32 logits are 512 MiB, and their
gradient as much again. A last row compiles the same step at V = 64 (memory only): what the model
needs without the vocabulary, a floor no loss tiling can go below (with `attention_impl=xla` the
`[B, N, T, T]` attention maps of the two layers are most of it). For the plain path
(`loss_chunk=0`) and each C, the jitted
`training.steps.train_step` is lowered and compiled ahead of time and its
`memory_analysis().temp_size_in_bytes` read (the flag above keeps XLA:CPU from fusing the reductions
into YNNPACK calls whose buffers the analysis does not count; the script sets it when unset). With
loss_chunk = C a tile holds the logits of B·T·C / V tokens (as many numbers as C vocabulary rows of
the batch; training.losses). The step times alternate: each round runs `--steps` steps of every
variant in turn on the same state,
so the load of a shared machine falls on all of them alike, and the table gives each variant's
median over the rounds and its ratio to the plain path's. Every variant's first step from the same
initial state is checked against the plain one (loss and gradient norm, relative 1e-5).
glibc malloc is tuned as train.py does (`training.host.tune_host_malloc`).

The target: with loss_chunk, temp memory <= 1/4 of the plain path's at >= 0.9x its speed.
"""

import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault('XLA_FLAGS', '--xla_cpu_experimental_ynn_fusion_type=-reduce')

from training import host

host.tune_host_malloc()  # before JAX starts its threads, as train.py

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import default  # noqa: E402
from training import losses  # noqa: E402
from training import state as state_lib  # noqa: E402
from training import steps as steps_lib  # noqa: E402
from training import validation  # noqa: E402

_CHUNKS = flags.DEFINE_list('chunks', ['2048', '4096', '8192'], 'Vocabulary tile sizes C.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Alternating rounds (every variant once per round).')
_STEPS = flags.DEFINE_integer('steps', 1, 'Timed steps per variant per round.')
_VOCAB = flags.DEFINE_integer('vocab', 32768, 'V.')
_LENGTH = flags.DEFINE_integer('length', 1024, 'T.')
_BATCH = flags.DEFINE_integer('batch', 4, 'B.')
_IMPL = flags.DEFINE_string('attention_impl', 'xla', 'model.attention_impl (xla: the default).')
_JSON = flags.DEFINE_bool('json', False, 'Print one JSON object per row instead of the table.')
FLOOR_VOCAB = 64


def make_config(length, batch):
  config = validation.resolve(default.get_config())
  config.model.update(num_layers=2, d_model=256, num_heads=4, num_kv_heads=4, d_ff=1024,
                      attention_impl=_IMPL.value)
  config.data.max_length = length
  config.train.update(batch_size=batch, diagnostics=False, warmup_steps=0)
  validation.validate(config)
  return config


def mib(n):
  return f'{n / 2 ** 20:,.1f} MiB'


def compile_step(config, vocab, chunk, batch):
  """(the compiled donated step, the initial state) of `config` at `vocab` with `loss_chunk`."""
  graphdef, tx, state = state_lib.create_state(config, vocab)
  fn = functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0), loss_chunk=chunk)
  return jax.jit(fn, donate_argnums=(0,)).lower(state, batch).compile(), state


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  v, t, b = _VOCAB.value, _LENGTH.value, _BATCH.value
  config = make_config(t, b)
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, v, (b, t + 1)).astype(np.int32)
  batch = jax.device_put({'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
                          'weights': np.ones((b, t), np.float32)})
  chunks = [0] + [int(c) for c in _CHUNKS.value]
  steps, temp = {}, {}
  for c in chunks:
    steps[c], state = compile_step(config, v, c, batch)
    temp[c] = steps[c].memory_analysis().temp_size_in_bytes
  floor = compile_step(config, FLOOR_VOCAB, 0, batch)[0].memory_analysis().temp_size_in_bytes
  # The first step of every variant from the same initial state: the same loss and gradient norm.
  first = {c: jax.device_get(steps[c](jax.tree.map(jnp.copy, state), batch)[1]) for c in chunks}
  for c in chunks:
    for key in ('loss_sum', 'grad_norm'):
      np.testing.assert_allclose(first[c][key], first[0][key], rtol=1e-5,
                                 err_msg=f'loss_chunk={c}: {key}')
  for c in chunks:  # warm-up: one step each
    state, sums = steps[c](state, batch)
  jax.block_until_ready(sums)
  times = {c: [] for c in chunks}
  for _ in range(_ROUNDS.value):
    for c in chunks:
      start = time.perf_counter()
      for _ in range(_STEPS.value):
        state, sums = steps[c](state, batch)
      jax.block_until_ready(sums)
      times[c].append((time.perf_counter() - start) / _STEPS.value)
  median = {c: statistics.median(times[c]) for c in chunks}
  rows = []
  for c in chunks:
    rows.append({'attention_impl': _IMPL.value, 'vocab': v, 'loss_chunk': c,
                 'tile_tokens': losses.tile_tokens(b, t, v, c) if c else b * t,
                 'temp_bytes': temp[c], 'temp_vs_plain': temp[c] / temp[0],
                 's_per_step': median[c], 'speed_vs_plain': median[0] / median[c],
                 'rounds_s': [round(x, 3) for x in times[c]]})
  rows.append({'attention_impl': _IMPL.value, 'vocab': FLOOR_VOCAB, 'loss_chunk': 0,
               'temp_bytes': floor, 'temp_vs_plain': floor / temp[0]})
  if _JSON.value:
    for row in rows:
      print(json.dumps(row))
    return
  print(f'V={v}, T={t}, B={b}, 2 layers x D=256, N=4, F=1024, float32, attention_impl='
        f'{_IMPL.value}; XLA_FLAGS={os.environ.get("XLA_FLAGS", "")}; {_ROUNDS.value} alternating '
        f'rounds of {_STEPS.value} step(s); logits [B, T, V] float32 = {mib(4 * b * t * v)}\n')
  print('| loss_chunk | tokens per tile | temp memory | vs plain '
        '| s/step (median) | speed vs plain '
        '| rounds (s) |')
  print('|---|---|---|---|---|---|---|')
  for row in rows[:-1]:
    print(f'| {row["loss_chunk"] or "0 (plain)"} | {row["tile_tokens"]:,} '
          f'| {mib(row["temp_bytes"])} '
          f'| {row["temp_vs_plain"]:.3f} | {row["s_per_step"]:.3f} '
          f'| {row["speed_vs_plain"]:.2f}x | {", ".join(f"{x:.2f}" for x in row["rounds_s"])} |')
  print(f'| V={FLOOR_VOCAB} (the model without the vocabulary) | - | {mib(floor)} '
        f'| {floor / temp[0]:.3f} | - | - | - |')


if __name__ == '__main__':
  app.run(main)
