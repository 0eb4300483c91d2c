"""Attention kernels benchmark: time, rate relative to a matmul, compiled temp memory and peak RSS.

    python benchmarks/attention.py --lengths=1024,2048 --impls=xla,blockwise --modes=fwd,fwd_bwd

Each measurement runs in its own subprocess so that its peak RSS is its own.
Prints a markdown table.
"""

import argparse
import json
import os
import subprocess
import sys
import time

# XLA on CPU otherwise fuses the dense reference into YNN kernels whose buffers the memory analysis
# does not report; must be set before jax is imported (here and, inherited, in the children).
os.environ.setdefault('XLA_FLAGS', '--xla_cpu_experimental_ynn_fusion_type=-reduce')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

B, N, H = 1, 8, 64


def _attention_flops(t, causal, mode):
  """Useful FLOPs: q·k and p·v are 2·T·S·H each per head; causal does about half; backward 2.5x."""
  fwd = 4 * B * N * t * t * H * (0.5 if causal else 1.0)
  return fwd if mode == 'fwd' else 3.5 * fwd


def _child(args):
  """One measurement; prints one JSON line."""
  import resource
  import jax
  import jax.numpy as jnp

  if args.child == 'matmul':
    m = 2048
    a = jnp.ones((m, m), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(f(a, a))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      jax.block_until_ready(f(a, a))
      times.append(time.perf_counter() - t0)
    print(json.dumps({'gflops': 2 * m ** 3 / min(times) / 1e9}))
    return

  from layers import attention
  impl, causal, t, mode = args.child.split(':')
  t, causal = int(t), causal == 'causal'
  kwargs = {}
  if impl != 'xla' and args.block_q:
    kwargs = dict(block_q=args.block_q, block_k=args.block_k)
  fn = attention.KERNELS[impl].fn
  if kwargs:
    import functools
    fn = functools.partial(fn, **kwargs)

  def attn(q, k, v):
    return fn(q, k, v, scale=H ** -0.5, is_causal=causal)

  if mode == 'fwd':
    f = attn
  else:
    f = jax.grad(lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(key, (B, t, N, H), jnp.float32) for key in keys)
  compiled = jax.jit(f).lower(q, k, v).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  result = {'temp': temp}
  if temp > args.mem_limit_gib * 2 ** 30:
    result['skipped'] = True
  elif impl == 'pallas' and t > args.pallas_max_len:
    result['not_timed'] = True
  else:
    # The first call is timed too (XLA compiled ahead of time; the CPU has nothing to warm up), so a
    # long measurement runs once; shorter ones repeat until --repeats or --max_seconds.
    times = []
    deadline = time.perf_counter() + args.max_seconds
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(compiled(q, k, v))
      times.append(time.perf_counter() - t0)
      if time.perf_counter() > deadline:
        break
    result['seconds'] = min(times)
  result['rss'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(json.dumps(result))


def _run_child(argv_tail, timeout):
  cmd = [sys.executable, os.path.abspath(__file__)] + argv_tail
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
  except subprocess.TimeoutExpired:
    return {'error': 'timeout'}
  lines = [l for l in proc.stdout.splitlines() if l.startswith('{')]
  if proc.returncode != 0 or not lines:
    return {'error': f'exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}'}
  return json.loads(lines[-1])


def _fmt_bytes(n):
  return f'{n / 2 ** 20:,.1f} MiB' if n < 2 ** 30 else f'{n / 2 ** 30:,.2f} GiB'


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--lengths', default='1024,2048,4096,8192,16384,32768')
  parser.add_argument('--impls', default='xla,blockwise,pallas')
  parser.add_argument('--modes', default='fwd,fwd_bwd')
  parser.add_argument('--causal', default='causal,full', help='causal, full or both')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--max_seconds', type=float, default=20.0,
                      help='stop repeating once a measurement has taken this long')
  parser.add_argument('--mem_limit_gib', type=float, default=8.0,
                      help='skip (OOM) where compiled temp memory exceeds this')
  parser.add_argument('--pallas_max_len', type=int, default=1024,
                      help='pallas runs interpreted on CPU: time it only up to this length')
  parser.add_argument('--block_q', type=int, default=0, help='kernel tile sizes (0: defaults)')
  parser.add_argument('--block_k', type=int, default=0)
  parser.add_argument('--timeout', type=float, default=900.0)
  parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(args)
    return

  passthrough = [f'--mem_limit_gib={args.mem_limit_gib}', f'--repeats={args.repeats}',
                 f'--max_seconds={args.max_seconds}', f'--pallas_max_len={args.pallas_max_len}',
                 f'--block_q={args.block_q}', f'--block_k={args.block_k}']
  matmul = _run_child(['--child=matmul'], args.timeout)['gflops']
  print(f'float32 matmul 2048^3: {matmul:.1f} GFLOP/s; B={B}, N={N}, H={H}, float32; '
        f'XLA_FLAGS={os.environ["XLA_FLAGS"]}\n', flush=True)
  print('| impl | mask | T | pass | time (s) | GFLOP/s | of matmul | temp memory | peak RSS |')
  print('|---|---|---|---|---|---|---|---|---|', flush=True)
  for causal in args.causal.split(','):
    for t in [int(x) for x in args.lengths.split(',')]:
      for mode in args.modes.split(','):
        for impl in args.impls.split(','):
          r = _run_child([f'--child={impl}:{causal}:{t}:{mode}'] + passthrough, args.timeout)
          temp = _fmt_bytes(r['temp']) if 'temp' in r else '-'
          rss = _fmt_bytes(r['rss']) if 'rss' in r else '-'
          if 'error' in r:
            cells = [r['error'], '-', '-']
          elif r.get('skipped'):
            cells = [f'OOM/skipped (> {args.mem_limit_gib:g} GiB)', '-', '-']
          elif r.get('not_timed'):
            cells = ['interpret, not timed', '-', '-']
          else:
            rate = _attention_flops(t, causal == 'causal', mode) / r['seconds'] / 1e9
            note = ' (interpret)' if impl == 'pallas' else ''
            cells = [f"{r['seconds']:.3f}{note}", f'{rate:.1f}', f'{rate / matmul:.0%}']
          print(f'| {impl} | {causal} | {t} | {mode} | ' + ' | '.join(cells) +
                f' | {temp} | {rss} |', flush=True)


if __name__ == '__main__':
  main()
