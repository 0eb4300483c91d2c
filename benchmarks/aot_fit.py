"""What fits where: GiB per chip of a decoder-only training step, by model size and TPU topology.

    python -m benchmarks.aot_fit [--rows=sizes,pod] [--length=2048]

Each row is one `python -m tools.aot ... --programs=train --json` (libtpu compiles the step for
the topology on this CPU host; see tools/aot.py): the sizes of configs/default.py's table with
the Pallas kernel on single hosts of v5e, v5p and v6e (fsdp over all chips), and the `xl` size
(about 1.2B parameters) on v5p-128 (64 chips) under fsdp and fsdp x tensor. Prints a markdown
table; the README's Scale section holds its output.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ('small', 'base', 'large')
TOPOLOGIES = ('v5e:2x2', 'v5p:2x2x2', 'v6e:2x2')
# (size, topology, mesh overrides, global batch) of the pod rows: the 1.2B model on v5p-128, and
# on a v5e host, where it does not fit.
POD = (('xl', 'v5p:4x4x4', {'fsdp': 64}, 64),
       ('xl', 'v5p:4x4x4', {'fsdp': 16, 'tensor': 4}, 64),
       ('xl', 'v5e:2x2', {'fsdp': 4}, 32))


def run(size, topology, mesh, batch, length):
  """The tool's JSON summary (or its error line) and the wall time of one row."""
  args = [sys.executable, '-m', 'tools.aot', f'--topology={topology}', '--programs=train',
          '--json', f'--config=configs/decoder_only.py:size={size}',
          '--config.model.attention_impl=pallas', f'--config.data.max_length={length}',
          f'--config.train.batch_size={batch}']
  args += [f'--config.mesh.{axis}={n}' for axis, n in mesh.items()] if mesh else ['--mesh=auto']
  start = time.perf_counter()
  r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=False)
  seconds = time.perf_counter() - start
  lines = r.stdout.strip().splitlines()
  if r.returncode in (0, 1) and lines and lines[-1].startswith('{') and 'mesh' in lines[-1]:
    return json.loads(lines[-1]), seconds
  return {'error': (r.stderr.strip().splitlines() or ['?'])[-1]}, seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rows', default='sizes,pod', help='sizes, pod, or both')
  parser.add_argument('--length', type=int, default=2048, help='tokens per row')
  parser.add_argument('--batch', type=int, default=32, help='global batch of the sizes rows')
  args = parser.parse_args()
  rows = []
  if 'sizes' in args.rows:
    rows += [(s, t, None, args.batch) for s in SIZES for t in TOPOLOGIES]
  if 'pod' in args.rows:
    rows += list(POD)
  print(f'Decoder-only train step, Pallas attention, {args.length} tokens a row, AdamW, float32 '
        'state; per chip: the compiled program\'s arguments + outputs + temporaries - aliased.\n')
  print('| size | parameters | topology | chips | mesh | batch | GiB per chip | HBM GiB | fits | '
        'compile s |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for size, topology, mesh, batch in rows:
    r, seconds = run(size, topology, mesh, batch, args.length)
    if 'mesh' not in r:
      print(f'| {size} | | {topology} | | | {batch} | | | error: {r["error"]} | {seconds:.0f} |')
      continue
    mesh_text = ' x '.join(f'{a} {n}' for a, n in r['mesh'].items() if n > 1)
    need = f'{r["per_chip_bytes"] / 2 ** 30:.2f}' if r.get('per_chip_bytes') else '?'
    if 'programs' not in r:  # the compiler refused: its count of the temporaries alone
      need = f'> {need}'
    params = f'{r["params"] / 1e6:,.0f}M' if r.get('params') else ''
    hbm = r.get('hbm_bytes') or 0
    print(f'| {size} | {params} | {topology} | {r.get("chips", "")} | {mesh_text} | {batch} | '
          f'{need} | {hbm / 2 ** 30:.0f} | {"yes" if r.get("fits") else "no"} | {seconds:.0f} |',
          flush=True)


if __name__ == '__main__':
  main()
