"""The TPU attention kernels alone, forward and backward, compiled for one chip from this host.

    python -m benchmarks.aot_kernels [--topology=v5p:2x2x2] [--length=8192] [--window=512]

One row of `--length` tokens, 4 heads of 32, causal, float32: the gradient of the kernel's
output (summed) with respect to q, k and v, compiled by libtpu for the topology's first chip,
with and without a causal window of `--window` tokens, for the Mosaic flash kernel (`pallas`)
and jax's splash kernel. Prints a markdown table of XLA's FLOPs, the roofline estimate
(`training.roofline`, from the compiled program, not a measurement) and the temporaries; the
window rows of docs/pods.md hold its output.
"""

import argparse

from training import aot

aot.quiet_libtpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from layers import attention  # noqa: E402
from layers import attention_pallas  # noqa: E402
from layers import attention_splash  # noqa: E402

KERNELS = {'pallas': attention_pallas.attention, 'splash': attention_splash.attention}
HEADS, HEAD_DIM = 4, 32


def compile_one(device, kernel, length, window):
  """aot.analyse's report of the kernel's forward and backward on `device`."""
  shape = jax.ShapeDtypeStruct((1, length, HEADS, HEAD_DIM), jnp.float32,
                               sharding=jax.sharding.SingleDeviceSharding(device))

  def loss(q, k, v):
    return KERNELS[kernel](q, k, v, scale=HEAD_DIM ** -0.5, is_causal=True,
                           window=None if window is None else (window, 0)).sum()

  fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  with attention.compiling_for(device.platform):
    compiled = fn.trace(shape, shape, shape).lower(
        lowering_platforms=(aot.lowering_platform(device),)).compile()
  return aot.analyse(compiled, [device])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--topology', default='v5p:2x2x2')
  parser.add_argument('--length', type=int, default=8192)
  parser.add_argument('--window', type=int, default=512)
  args = parser.parse_args()
  device = aot.topology_devices(args.topology)[0]
  print('| kernel | window | XLA FLOPs | estimated step | bound | temporaries |')
  print('|---|---|---|---|---|---|')
  for kernel in KERNELS:
    for window in (None, args.window):
      r = compile_one(device, kernel, args.length, window)
      e = r['estimate']
      print(f"| {kernel} | {window or 'none'} | {r['flops']:.3g} | {e['step_s'] * 1e3:.3f} ms | "
            f"{e['bound']} | {r['bytes']['temp'] / 2 ** 20:.1f} MiB |", flush=True)


if __name__ == '__main__':
  main()
