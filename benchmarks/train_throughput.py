"""Training throughput and MFU of train.py's step on this machine.

    .venv/bin/python benchmarks/train_throughput.py [--steps=20] [--dropout=0,0.1]

For each size below (the issue's (a) and (b)), times the jitted `train.train_step` on random tokens
(no input pipeline: the step alone) and prints tokens/s and the model FLOPs utilisation

    MFU = (6·N + 12·L·T·D) · tokens/s / (float32 matmul FLOP/s measured in the same run),

N = non-embedding parameters, L layers, T length, D d_model (the PaLM appendix-B count: weight
matmuls forward and backward, plus the attention scores QK^T and PV). The peak is a 2048³ float32
matmul jitted on all cores. Run it alone: the number is a share of this machine, so any other load
lowers it.
"""

import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=wrong-import-position
from absl import flags  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

from configs import default  # pylint: disable=wrong-import-position
from configs import validation  # pylint: disable=wrong-import-position
import train  # pylint: disable=wrong-import-position

_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps per size (after 2 warm-up steps).')
_DROPOUT = flags.DEFINE_list('dropout', ['0', '0.1'], 'Dropout rates to time.')
_SIZES = flags.DEFINE_list('sizes', ['a', 'b'], 'Which sizes to run.')

VOCAB = 8000
# name -> (num_layers, d_model, num_heads, d_ff, length, batch)
SIZES = {'a': (6, 512, 8, 2048, 256, 8), 'b': (2, 128, 4, 512, 128, 32)}


def matmul_flops_per_sec(n=2048, reps=10):
  """Measured float32 matmul FLOP/s (2·n³ per product) on every core."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  start = time.perf_counter()
  for _ in range(reps):
    out = f(a)
  out.block_until_ready()
  return 2 * n ** 3 * reps / (time.perf_counter() - start)


def make_config(size, dropout):
  layers, d, heads, d_ff, length, batch = SIZES[size]
  config = default.get_config()
  config.model.update(num_layers=layers, d_model=d, num_heads=heads, num_kv_heads=heads, d_ff=d_ff,
                      dropout=float(dropout))
  config.data.max_length = length
  config.train.update(batch_size=batch, diagnostics=False, warmup_steps=0)
  validation.validate(validation.resolve(config))
  return config


def model_flops_per_token(config, params):
  m = config.model
  n = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
          if 'embed' not in jax.tree_util.keystr(path))  # non-embedding parameters
  return 6 * n + 12 * m.num_layers * config.data.max_length * m.d_model, n


def time_steps(config, steps):
  graphdef, tx, state = train.create_state(config, VOCAB)
  flops_per_token, n = model_flops_per_token(config, state['params'])
  b, t = config.train.batch_size, config.data.max_length
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, VOCAB, (b, t + 1)).astype(np.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
           'weights': np.ones((b, t), np.float32)}
  step = jax.jit(functools.partial(train.train_step, graphdef, tx, jax.random.key(0)),
                 donate_argnums=(0,))
  for _ in range(2):
    state, sums = step(state, batch)
  jax.block_until_ready(sums)
  start = time.perf_counter()
  for _ in range(steps):
    state, sums = step(state, batch)
  jax.block_until_ready(sums)
  elapsed = time.perf_counter() - start
  return b * t * steps / elapsed, flops_per_token, n, elapsed / steps


def main(argv):
  del argv
  peak = matmul_flops_per_sec()
  print(f'float32 matmul peak (2048^3, jitted, {os.cpu_count()} cores): {peak / 1e9:.1f} GFLOP/s')
  print('MFU = (6·N + 12·L·T·D) · tokens/s / peak  (N: non-embedding parameters)\n')
  print('| size | layers x d_model, heads, d_ff, T, B | N | dropout | s/step | tokens/s '
        '| model GFLOP/s | MFU |')
  print('|---|---|---|---|---|---|---|---|')
  for size in _SIZES.value:
    layers, d, heads, d_ff, length, batch = SIZES[size]
    for dropout in _DROPOUT.value:
      tok_s, fpt, n, per_step = time_steps(make_config(size, dropout), _STEPS.value)
      print(f'| ({size}) | {layers} x {d}, {heads}, {d_ff}, {length}, {batch} | {n:,} | {dropout} '
            f'| {per_step:.3f} | {tok_s:,.0f} | {fpt * tok_s / 1e9:.1f} | {fpt * tok_s / peak:.2f} |',
            flush=True)


if __name__ == '__main__':
  app.run(main)
