"""Accelerator check of the flash kernels: correctness against `xla`, then fwd+bwd speed (markdown).

    python benchmarks/device_check.py              # on a GPU or TPU host
    python benchmarks/device_check.py --dry_run    # on CPU: every code path, tiny, interpreted

1. Correctness at 1k-8k (float32 and bfloat16): `implementation='pallas'` against `xla` (float32,
   highest matmul precision), forward and dQ/dK/dV, as the largest error relative to the largest
   reference value; and the lowered program must hold the platform's kernel (a Triton call on GPU,
   a Mosaic call on TPU), so a silent fallback cannot pass.
2. Speed at 1k-32k in bfloat16: the best of `--repeats` jitted fwd+bwd steps of pallas,
   blockwise and
   xla, plus cuDNN (`jax.nn.dot_product_attention(implementation='cudnn')`) on GPU; TFLOP/s count
   useful FLOPs (forward 4·B·N·T²·H, half for causal, fwd+bwd 3.5x the forward).

The exit status is 1 when any correctness row fails (and 0 otherwise, whatever the speeds).
"""

import argparse
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from layers import attention  # noqa: E402
from layers import attention_pallas_tpu  # noqa: E402
from layers import masks  # noqa: E402

# Matmuls in float32 run as TF32 on GPU and as bfloat16 passes on TPU at default precision, so the
# kernels' float32 errors are those of ~10-bit mantissas; bfloat16 inputs have 8 bits.
REL_TOL = {'float32': 1e-2, 'bfloat16': 5e-2}
# Correctness problems: (name, kv heads, dot_product_attention options); N = 4 query heads.
CHECKS = [
    ('causal_gqa', 2, dict(is_causal=True)),
    ('window_alibi_mqa', 1, dict(local_window_size=(512, 0), alibi=True, is_causal=True)),
    ('segments_bidirectional', 4, dict(segments=True)),
    ('softcap_sinks_gqa', 2, dict(is_causal=True, softcap=30.0, sinks=True)),
]
# The custom call of each platform's Pallas kernel (the backend name, and the lowering platform
# names the dry run lowers for).
KERNEL_CALL = {'gpu': '__gpu$xla.gpu.triton', 'cuda': '__gpu$xla.gpu.triton',
               'tpu': 'tpu_custom_call'}


def _pallas_tpu_interpret(q, k, v, bias=None, mask=None, **kwargs):
  """The Mosaic TPU kernel in Pallas's TPU interpret mode (dry run on CPU only)."""
  assert bias is None and mask is None
  return attention_pallas_tpu.attention(q, k, v, interpret=True, **kwargs)


def _impl(name):
  """`[B, T, N, H]` attention of the name, with dot_product_attention's keywords."""
  if name == 'cudnn':
    return lambda q, k, v, **kw: jax.nn.dot_product_attention(q, k, v, implementation='cudnn', **kw)
  if name == 'pallas_tpu_interpret':
    def run(q, k, v, *, is_causal=False, local_window_size=None, alibi_slopes=None,
            segment_ids=None, softcap=None, sinks=None):
      window = masks.normalize_window(local_window_size)
      return _pallas_tpu_interpret(
          q, k, v, scale=1.0 / np.sqrt(q.shape[-1]), is_causal=is_causal, window=window,
          alibi_slopes=alibi_slopes, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
          softcap=softcap, sinks=sinks)
    return run
  return functools.partial(attention.dot_product_attention, implementation=name)


def _problem(b, t, n, kv, h, dtype, seed=0):
  rng = np.random.default_rng(seed)
  shapes = [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)]
  q, k, v, ct = (rng.standard_normal(s, np.float32) for s in shapes)
  return [jnp.asarray(x, dtype) for x in (q, k, v)], jnp.asarray(ct, dtype)


def _step(fn, **kwargs):
  """jit(q, k, v, ct) -> (out, (dq, dk, dv)): the forward and the vjp of the cotangent ct."""

  def step(q, k, v, ct):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kwargs), q, k, v)
    return out, vjp(ct.astype(out.dtype))

  return jax.jit(step)


def _options(opts, n, t):
  kwargs = dict(opts)
  if kwargs.pop('alibi', False):
    kwargs['alibi_slopes'] = jnp.asarray(2.0 ** (-8.0 * np.arange(1, n + 1) / n), jnp.float32)
  if kwargs.pop('sinks', False):
    kwargs['sinks'] = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32)
  if kwargs.pop('segments', False):
    kwargs['segment_ids'] = jnp.asarray((np.arange(t)[None] // (t // 3 + 7)).astype(np.int32))
  return kwargs


def _holds_kernel(step, args, platforms):
  """Whether `step` lowered for each of `platforms` (None: this host's) holds its Pallas kernel."""
  for platform in platforms:
    if platform is None:
      text, platform = step.lower(*args).as_text(), jax.default_backend()
    else:
      text = step.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    if KERNEL_CALL[platform] not in text:
      return False
  return True


def correctness(impls, lengths, platforms):
  """Rows of the correctness table, and whether all passed.

  `platforms`: where 'pallas' must lower to its kernel: [None] (this accelerator) or, in the dry run
  on CPU, ['cuda', 'tpu'] (lowered only, as in tests/unit/test_pallas_lowering.py).
  """
  rows, ok_all = [], True
  n, h = 4, 128
  for t in lengths:
    for name, kv, opts in CHECKS:
      kwargs = _options(opts, n, t)
      for dtype in ('float32', 'bfloat16'):
        (q, k, v), ct = _problem(1, t, n, kv, h, dtype)
        f32 = [x.astype(jnp.float32) for x in (q, k, v, ct)]
        with jax.default_matmul_precision('highest'):
          want = jax.tree.leaves(_step(_impl('xla'), **kwargs)(*f32))
        for impl in impls:
          step = _step(_impl(impl), **kwargs)
          has_kernel = _holds_kernel(step, (q, k, v, ct), platforms) if impl == 'pallas' else None
          got = jax.tree.leaves(step(q, k, v, ct))
          errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
                  for g, w in zip(got, want)]
          ok = all(np.isfinite(e) and e <= REL_TOL[dtype] for e in errs) and has_kernel is not False
          ok_all &= ok
          rows.append([impl, t, name, dtype] + [f'{e:.1e}' for e in errs] +
                       ['-' if has_kernel is None else ('yes' if has_kernel else 'NO'),
                        'ok' if ok else 'FAIL'])
  return rows, ok_all


def _flops(b, n, t, h, causal):
  return 3.5 * 4 * b * n * t * t * h * (0.5 if causal else 1.0)


def speed(impls, lengths, causal, repeats, b, n, h):
  """Rows of the speed table (bfloat16 fwd+bwd) and {(impl, T): seconds}."""
  rows, seconds = [], {}
  for t in lengths:
    (q, k, v), ct = _problem(b, t, n, n, h, jnp.bfloat16)
    for impl in impls:
      try:
        step = _step(_impl(impl), is_causal=causal)
        jax.block_until_ready(step(q, k, v, ct))  # compile and warm up
        best = float('inf')
        for _ in range(repeats):
          t0 = time.perf_counter()
          jax.block_until_ready(step(q, k, v, ct))
          best = min(best, time.perf_counter() - t0)
      except Exception as e:  # noqa: BLE001
        # Out of memory (xla at long lengths) or an implementation this platform lacks: a row
        # that says so, not a crash that loses the other rows.
        rows.append([impl, t, f'{type(e).__name__}: {str(e).splitlines()[0][:60]}', '-'])
        continue
      seconds[impl, t] = best
      rows.append([impl, t, f'{best * 1e3:.2f}', f'{_flops(b, n, t, h, causal) / best / 1e12:.1f}'])
  return rows, seconds


def _table(header, rows):
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
  return '\n'.join(lines + ['| ' + ' | '.join(str(c) for c in r) + ' |' for r in rows])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--dry_run', action='store_true',
                      help='tiny lengths, one repeat, kernels interpreted: runs on CPU')
  parser.add_argument('--check_lengths', default='1024,2048,4096,8192')
  parser.add_argument('--bench_lengths', default='1024,2048,4096,8192,16384,32768')
  parser.add_argument('--causal', default='causal', choices=['causal', 'full'])
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--heads', type=int, default=16)
  parser.add_argument('--head_dim', type=int, default=128)
  args = parser.parse_args(argv)

  platform = jax.default_backend()
  device = jax.devices()[0]
  check_lengths = [int(x) for x in args.check_lengths.split(',')]
  bench_lengths = [int(x) for x in args.bench_lengths.split(',')]
  repeats, heads = args.repeats, args.heads
  impls = ['pallas', 'blockwise', 'xla'] + (['cudnn'] if platform == 'gpu' else [])
  if args.dry_run:
    # On CPU 'pallas' is the interpreted Triton kernel; the TPU kernel runs in TPU interpret mode.
    check_lengths, bench_lengths, repeats, heads = [200], [256], 1, 2
    impls = ['pallas', 'pallas_tpu_interpret', 'blockwise', 'xla']
  elif platform not in KERNEL_CALL:
    parser.error(f'no GPU or TPU here (backend {platform!r}); use --dry_run')

  print(f'# Flash kernel device check: {device.device_kind} ({platform}), jax {jax.__version__}'
        + (' [dry run: interpreted kernels, tiny sizes; times mean nothing]' if args.dry_run
           else ''))
  print('\n## Correctness against xla (float32, highest precision): max |err| / max |ref|\n')
  rows, ok = correctness([i for i in impls if i not in ('xla', 'cudnn')], check_lengths,
                         ['cuda', 'tpu'] if args.dry_run else [None])
  print(_table(['impl', 'T', 'options', 'dtype', 'out', 'dq', 'dk', 'dv', 'kernel in program',
                'result'], rows))
  print(f'\n## fwd+bwd, bfloat16, {args.causal}, B={args.batch} N=K={heads} H={args.head_dim}, '
        f'best of {repeats}\n')
  rows, seconds = speed(impls, bench_lengths, args.causal == 'causal', repeats, args.batch, heads,
                        args.head_dim)
  print(_table(['impl', 'T', 'time (ms)', 'TFLOP/s'], rows))
  for t in bench_lengths:
    if ('pallas', t) in seconds and ('cudnn', t) in seconds:
      print(f'\npallas speed / cuDNN speed at T={t}: '
            f'{seconds["cudnn", t] / seconds["pallas", t]:.2f}')
  print(f'\ncorrectness: {"all rows ok" if ok else "MISMATCH"}')
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
