"""Compile time of the train step versus depth, unrolled vs scanned layers (model.scan_layers).

  python -m benchmarks.compile_time [--depths=2,6,12,24] [--remats=none,full]

For each depth and layout: `state_lib.create_state` (timed as "init"), then
`jax.jit(training.steps.train_step ...).lower(state, batch)` ("lower": tracing to StableHLO) and
`.compile()` ("compile": XLA), each timed once on the default backend. Decoder-only, D=128, N=4,
F=512, T=64, B=8, float32; one warm-up compile first so that the first row does not pay for
loading XLA. Prints a markdown table; the target is scanned 24 layers at most 1.5x the
lower+compile time of scanned 2 layers.
"""

import functools
import time

from absl import app
from absl import flags
import jax
import numpy as np

from configs import default
from training import validation
from training import state as state_lib
from training import steps as steps_lib

_DEPTHS = flags.DEFINE_list('depths', ['2', '6', '12', '24'], 'Numbers of layers.')
_REMATS = flags.DEFINE_list('remats', ['none', 'full'], 'Remat policies of the scanned rows.')
_VOCAB = flags.DEFINE_integer('vocab', 64, 'V (compile time hardly depends on it).')
B, T = 8, 64


def make_config(num_layers, scan_layers, remat):
  config = validation.resolve(default.get_config())
  config.model.update(num_layers=num_layers, d_model=128, num_heads=4, num_kv_heads=4, d_ff=512,
                      scan_layers=scan_layers, remat=remat)
  config.data.max_length = T
  config.train.batch_size = B
  validation.validate(config)
  return config


def measure(config):
  """(init, lower, compile) seconds of one train step of `config`."""
  rng = np.random.default_rng(0)
  batch = {'inputs': rng.integers(1, _VOCAB.value, (B, T)).astype(np.int32),
           'targets': rng.integers(1, _VOCAB.value, (B, T)).astype(np.int32),
           'weights': np.ones((B, T), np.float32)}
  t0 = time.perf_counter()
  graphdef, tx, state = state_lib.create_state(config, _VOCAB.value)
  jax.block_until_ready(state)
  t1 = time.perf_counter()
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0)),
                 donate_argnums=(0,))
  lowered = step.lower(state, batch)
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return t1 - t0, t2 - t1, t3 - t2


def main(_):
  measure(make_config(1, False, 'none'))  # warm-up: XLA's first compile loads its passes
  layouts = [('unrolled', False, 'none')] + [(f'scanned (remat {r})', True, r)
                                             for r in _REMATS.value]
  rows, base = [], {}
  for name, scan, remat in layouts:
    for depth in map(int, _DEPTHS.value):
      init, lower, comp = measure(make_config(depth, scan, remat))
      base.setdefault(name, lower + comp)
      rows.append((name, depth, init, lower, comp, lower + comp, (lower + comp) / base[name]))
      print(f'{name} L={depth}: init {init:.2f}s lower {lower:.2f}s compile {comp:.2f}s',
            flush=True)
  print(f'\nbackend {jax.default_backend()}, {jax.device_count()} device(s); decoder-only D=128 '
        f'N=4 F=512 T={T} B={B} V={_VOCAB.value} float32\n')
  print('| layers | depth | init (s) | lower (s) | compile (s) | lower+compile (s) | '
        f'vs depth {_DEPTHS.value[0]} |')
  print('|---|---|---|---|---|---|---|')
  for name, depth, init, lower, comp, total, ratio in rows:
    print(f'| {name} | {depth} | {init:.2f} | {lower:.2f} | {comp:.2f} | {total:.2f} | '
          f'{ratio:.2f}x |')


if __name__ == '__main__':
  app.run(main)
