"""Training throughput and MFU of train.py's step on this machine.

    .venv/bin/python benchmarks/train_throughput.py [--steps=20] [--dropout=0,0.1]
        [--host_malloc=tuned,default]

For each size below (the issue's (a) and (b)), times the jitted `training.steps.train_step` on random tokens
(no input pipeline: the step alone) and prints tokens/s and the model FLOPs utilisation

    MFU = 3 · (forward FLOPs per token) · tokens/s / (float32 matmul FLOP/s measured in the same run)

with the forward FLOPs of `models.accounting.forward_flops` (the count `python -m tools.accounting`
prints and tests against XLA's cost analysis): every weight matmul including the tied D x V output
projection, plus the full T x T attention scores QK^T and PV, i.e. PaLM appendix B's 6·N + 12·L·T·D
with N the parameters that take part in a matmul (as nanoGPT counts them). The peak is the best of
five rounds of a 2048³ float32 matmul jitted on all cores. Each `--host_malloc` setting runs in its
own process (glibc reads the arena limit before threads start): 'tuned' is `host.tune_host_malloc`,
what train.py applies, 'default' glibc as it comes. Run it alone: the numbers are a share of this
machine, so any other load lowers them.
"""

import functools
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=wrong-import-position
from absl import flags  # pylint: disable=wrong-import-position
from absl import logging  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from configs import default  # pylint: disable=wrong-import-position
from training import validation  # pylint: disable=wrong-import-position
from models import accounting  # pylint: disable=wrong-import-position
from training import host
from training import state as state_lib
from training import steps as steps_lib

_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps per size (after 2 warm-up steps).')
_DROPOUT = flags.DEFINE_list('dropout', ['0', '0.1'], 'Dropout rates to time.')
_SIZES = flags.DEFINE_list('sizes', ['a', 'b'], 'Which sizes to run.')
_MALLOC = flags.DEFINE_list('host_malloc', ['tuned', 'default'], 'glibc malloc settings to time, '
                            'each in its own process: tuned (train.py\'s) and/or default.')
_PEAK = flags.DEFINE_float('peak', 0.0, 'Internal: the peak FLOP/s measured by the parent run.')

VOCAB = 8000
# name -> (num_layers, d_model, num_heads, d_ff, length, batch)
SIZES = {'a': (6, 512, 8, 2048, 256, 8), 'b': (2, 128, 4, 512, 128, 32)}


def matmul_flops_per_sec(n=2048, reps=5, rounds=5):
  """Float32 matmul FLOP/s (2·n³ per product) on every core: the best of `rounds` timings."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  best = 0.0
  for _ in range(rounds):
    start = time.perf_counter()
    for _ in range(reps):
      out = f(a)
    out.block_until_ready()
    best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - start))
  return best


def make_config(size, dropout):
  layers, d, heads, d_ff, length, batch = SIZES[size]
  config = default.get_config()
  config.model.update(num_layers=layers, d_model=d, num_heads=heads, num_kv_heads=heads, d_ff=d_ff,
                      dropout=float(dropout))
  config.data.max_length = length
  config.train.update(batch_size=batch, diagnostics=False, warmup_steps=0)
  validation.validate(validation.resolve(config))
  return config


def model_flops_per_token(config):
  """Training FLOPs per token: 3 x forward (the backward pass is two matmuls per forward one)."""
  t = config.data.max_length
  fl = accounting.forward_flops(config.model, VOCAB, t)
  return 3 * (fl['matmul'] + fl['scores']) / t


def time_steps(config, steps):
  graphdef, tx, state = state_lib.create_state(config, VOCAB)
  flops_per_token = model_flops_per_token(config)
  b, t = config.train.batch_size, config.data.max_length
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, VOCAB, (b, t + 1)).astype(np.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'weights': np.ones((b, t), np.float32)}
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0)),
                 donate_argnums=(0,))
  for _ in range(2):
    state, sums = step(state, batch)
  jax.block_until_ready(sums)
  start = time.perf_counter()
  for _ in range(steps):
    state, sums = step(state, batch)
  jax.block_until_ready(sums)
  elapsed = time.perf_counter() - start
  return b * t * steps / elapsed, flops_per_token, elapsed / steps


def time_rows(peak, malloc):
  """The table rows of every size and dropout rate, in this process."""
  for size in _SIZES.value:
    layers, d, heads, d_ff, length, batch = SIZES[size]
    for dropout in _DROPOUT.value:
      tok_s, fpt, per_step = time_steps(make_config(size, dropout), _STEPS.value)
      print(f'| ({size}) | {layers} x {d}, {heads}, {d_ff}, {length}, {batch} | {fpt / 1e6:.1f} M '
            f'| {dropout} | {malloc} | {per_step:.3f} | {tok_s:,.0f} | {fpt * tok_s / 1e9:.1f} '
            f'| {fpt * tok_s / peak:.2f} |', flush=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _PEAK.value:  # a child: one malloc setting, already applied before JAX started
    time_rows(_PEAK.value, _MALLOC.value[0])
    return
  peak = matmul_flops_per_sec()
  print(f'float32 matmul peak (2048^3, jitted, best of 5, {os.cpu_count()} cores): '
        f'{peak / 1e9:.1f} GFLOP/s')
  print('MFU = 3 · forward FLOPs per token (models.accounting: weight matmuls incl. the D x V output, '
        'full attention scores) · tokens/s / peak\n')
  print('| size | layers x d_model, heads, d_ff, T, B | training FLOPs/token | dropout | malloc '
        '| s/step | tokens/s | model GFLOP/s | MFU |')
  print('|---|---|---|---|---|---|---|---|---|')
  for malloc in _MALLOC.value:
    child = [a for a in sys.argv[1:] if not a.startswith(('--host_malloc', '--peak'))]
    subprocess.run([sys.executable, os.path.abspath(__file__), *child, f'--host_malloc={malloc}',
                    f'--peak={peak}'], check=True)


if __name__ == '__main__':
  if '--host_malloc=tuned' in sys.argv and any(a.startswith('--peak=') for a in sys.argv):
    host.tune_host_malloc()  # before JAX starts its threads
  app.run(main)
