"""Attention variants benchmark: time and compiled temp memory of each variant's kernel \
against dense.

    python benchmarks/attention_variants.py --lengths=1024,2048,4096,8192 --modes=fwd,fwd_bwd

B=1, N=K=8, H=64, float32, bidirectional (`--causal` for the decoder form). One process; each row is
compiled ahead of time, so "temp" is XLA's memory analysis of that program. Prints a markdown table
and, per variant, temp(16k)/temp(4k) (linear growth: <= 4.5) where both lengths were run.
"""

import argparse
import json
import os
import sys
import time

# XLA on CPU otherwise fuses the dense reference into YNN kernels whose buffers the memory analysis
# does not report; must be set before jax is imported (as in benchmarks/attention.py).
os.environ.setdefault('XLA_FLAGS', '--xla_cpu_experimental_ynn_fusion_type=-reduce')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from layers import attention_blockwise  # noqa: E402
from layers import attention_xla  # noqa: E402
from layers import linear_attention  # noqa: E402
from layers import masks  # noqa: E402
from layers import sparse_attention  # noqa: E402

B, N, H = 1, 8, 64
SCALE = H ** -0.5
WINDOW = 256  # sliding_window / longformer: w
GLOBAL = (0,)  # longformer / bigbird global tokens
BIGBIRD_BLOCK, BIGBIRD_RANDOM = 64, 3  # 3 local + 3 random blocks of 64: 384 keys per query
LINFORMER_K = 256
PERFORMER_M = 256


def make(variant, t, causal):
  """(fn(q, k, v, extra), extra) for one variant at length t."""
  if variant == 'dense':
    return lambda q, k, v, _: attention_xla.attention(q, k, v, scale=SCALE, is_causal=causal), None
  if variant == 'dense_flash':
    return lambda q, k, v, _: attention_blockwise.attention(q, k, v, scale=SCALE,
                                                            is_causal=causal), None
  if variant in ('sliding_window', 'longformer', 'bigbird'):
    if variant == 'bigbird':
      nb = -(-t // BIGBIRD_BLOCK)
      pattern = masks.SparsePattern(block=BIGBIRD_BLOCK, block_window=1, global_tokens=GLOBAL,
                                    random_blocks=sparse_attention.bigbird_random_blocks(
                                        nb, BIGBIRD_RANDOM, 1, causal, 0))
      block = BIGBIRD_BLOCK
    else:
      pattern = masks.SparsePattern(window=(WINDOW, WINDOW),
                                    global_tokens=GLOBAL if variant == 'longformer' else ())
      block = WINDOW
    return (lambda q, k, v, _: sparse_attention.sparse_attention(
        q, k, v, pattern, scale=SCALE, block=block, is_causal=causal)), None
  if variant == 'linformer':
    e = jax.random.normal(jax.random.key(1), (2, LINFORMER_K, t)) / t ** 0.5

    def linformer(q, k, v, e):
      kp = jnp.einsum('RS,BSKH->BRKH', e[0], k)
      vp = jnp.einsum('RS,BSKH->BRKH', e[1], v)
      return attention_xla.attention(q, kp, vp, scale=SCALE)
    return linformer, e
  if variant == 'performer':
    w = jnp.asarray(linear_attention.orthogonal_features_np(1, PERFORMER_M, H))

    def performer(q, k, v, w):
      qf, kf = linear_attention.performer_features(q[:, :, :, None], k, w, SCALE)
      return linear_attention.kernel_attention(qf, kf, v, is_causal=causal)[:, :, :, 0]
    return performer, w
  if variant == 'linear':
    def linear(q, k, v, _):
      qf, kf = linear_attention.elu_plus_one(q[:, :, :, None]), linear_attention.elu_plus_one(k)
      return linear_attention.kernel_attention(qf, kf, v, is_causal=causal)[:, :, :, 0]
    return linear, None
  raise ValueError(f'variant {variant!r} unknown')


def measure(variant, t, mode, causal, args):
  fn, extra = make(variant, t, causal)
  if mode == 'fwd':
    f = fn
  else:
    f = jax.grad(lambda q, k, v, x: fn(q, k, v, x).sum(), argnums=(0, 1, 2))
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (B, t, N, H), jnp.float32) for key in keys)
  compiled = jax.jit(f).lower(q, k, v, extra).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  if temp > args.mem_limit_gib * 2 ** 30:
    return temp, None
  times = []
  while len(times) < args.repeats and sum(times) < args.max_seconds:
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, extra))
    times.append(time.perf_counter() - t0)
  return temp, min(times)


def _fmt_bytes(n):
  return f'{n / 2 ** 30:.2f} GiB' if n >= 2 ** 30 else f'{n / 2 ** 20:.1f} MiB'


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--lengths', default='1024,2048,4096,8192,16384')
  p.add_argument('--variants', default='dense,dense_flash,sliding_window,longformer,bigbird,'
                 'linformer,performer,linear')
  p.add_argument('--modes', default='fwd,fwd_bwd')
  p.add_argument('--causal', action='store_true', help='decoder form (linformer is skipped)')
  p.add_argument('--repeats', type=int, default=3)
  p.add_argument('--max_seconds', type=float, default=10.0)
  p.add_argument('--mem_limit_gib', type=float, default=8.0, help='not run above this temp')
  p.add_argument('--json', default='', help='also write the rows to this JSON file (read by '
                 'benchmarks/attention_tradeoff.py)')
  args = p.parse_args()
  lengths = [int(x) for x in args.lengths.split(',')]
  variants = args.variants.split(',')
  print(f'B={B}, N=K={N}, H={H}, float32, {"causal" if args.causal else "bidirectional"}; '
        f'XLA_FLAGS={os.environ.get("XLA_FLAGS")}\n')
  print('| variant | T | pass | time (s) | temp memory |')
  print('|---|---|---|---|---|')
  temps = {}
  rows = []
  for variant in variants:
    if variant == 'linformer' and args.causal:
      continue
    for t in lengths:
      for mode in args.modes.split(','):
        temp, secs = measure(variant, t, mode, args.causal, args)
        temps[variant, t, mode] = temp
        shown = f'{secs:.3f}' if secs is not None else 'not run (temp > limit)'
        print(f'| {variant} | {t} | {mode} | {shown} | {_fmt_bytes(temp)} |', flush=True)
        rows.append({'variant': variant, 'length': t, 'mode': mode, 'seconds': secs,
                     'temp_bytes': int(temp), 'causal': args.causal})
        if args.json:  # rewritten after every row: a long run killed midway keeps what it measured
          with open(args.json, 'w') as f:
            json.dump({'batch': B, 'heads': N, 'head_dim': H, 'dtype': 'float32',
                       'xla_flags': os.environ.get('XLA_FLAGS'), 'rows': rows}, f, indent=1)
  print()
  for (variant, t, mode), temp in sorted(temps.items()):
    if t == 16384 and (variant, 4096, mode) in temps:
      ratio = temp / max(temps[variant, 4096, mode], 1)
      print(f'{variant} {mode}: temp(16k)/temp(4k) = {ratio:.2f}')


if __name__ == '__main__':
  main()
