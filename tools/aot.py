"""Compiles a config (or every cell of a sweep) for a TPU topology this host does not have.

    python -m tools.aot --topology=v5p:4x4x4 --config=configs/decoder_only.py [--config.F=V ...]
        [--mesh=auto|search] [--programs=train,eval,decode] [--json]
    python -m tools.aot --topology=v5p:2x2x2 --sweep=configs/ablations/NAME.py[:ARG] [--mesh=auto]

libtpu (`pip install "jax[tpu]==<jax's version>"`) describes the topology as compile-only devices
and compiles the train step, the eval step and the cached decode step for them on this CPU host
(training.aot), with the training state built abstractly (no memory) and sharded by the config's
mesh; `--mesh=auto` puts fsdp over all chips; `--mesh=search` compiles every mesh of the chip
count over data, fsdp and tensor (and expert for an MoE) and ranks those that fit by estimated step
time. The report, per chip: the bytes of each program's arguments, outputs, temporaries and aliased
(donated) buffers against the chip's HBM, XLA's FLOPs beside models.accounting's, the collectives,
the custom calls (Mosaic kernels: `tpu_custom_call`) and a roofline estimate of the step
(training.roofline: an estimate from the compiled program, not a measurement). `--json` prints one
JSON object as the last line.

Exit status: 0 when everything compiles and fits; 1 when it does not fit ("needs X GiB per chip,
v5e has 16"; "needs at least X" where libtpu's compiler refuses, counting the temporaries alone) or
fails to compile; 2 for a config, mesh or topology error (one line each).
"""

import json
import math
import re
import signal
import sys
import time

from absl import app
from absl import flags
from absl import logging

from training import aot

aot.quiet_libtpu()  # before jax starts: none of libtpu's start-up noise in the report


from ml_collections import config_flags  # noqa: E402
import tqdm  # noqa: E402

from layers import attention  # noqa: E402
from layers import options  # noqa: E402
import models  # noqa: E402
from layers import sharding  # noqa: E402
from tools import accounting  # noqa: E402
from tools.sweep import spec as sweep_spec  # noqa: E402
from training import cli_checks  # noqa: E402
from training import config_file  # noqa: E402
from training import state as state_lib  # noqa: E402
from training import validation  # noqa: E402

FLAGS = flags.FLAGS
PROGRAMS = ('train', 'eval', 'decode')


def define_flags():
  """The CLI flags, defined only when run as a program (tests import this module)."""
  config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py).', lock_config=True)
  flags.DEFINE_string('topology', None, 'TPU topology libtpu knows, e.g. v5p:2x2x2, v5e:2x2, '
                      'v5p:4x4x4 (64 chips), v6e:4x4.')
  flags.DEFINE_string('sweep', None, 'Compile every cell of configs/ablations/NAME.py[:ARG] '
                      '(its first seed) instead of --config.')
  flags.DEFINE_enum('mesh', 'config', ['config', 'auto', 'search'], 'config: the config\'s mesh '
                    'sizes; auto: fsdp over all chips; search: every mesh of the chip count, '
                    'ranked by estimated step time.')
  flags.DEFINE_list('programs', list(PROGRAMS), f'Which of {", ".join(PROGRAMS)} to compile.')
  flags.DEFINE_bool('json', False, 'Print one JSON object (the summary) as the last line.')


class DoesNotFit(Exception):
  """The compiler ran out of HBM: (bytes it named, or None; its first line)."""


def gib(x):
  return f'{x / aot.GiB:.2f}'


def compile_one(config, devices):
  """(summary dict, seconds) of one config; DoesNotFit when the compiler refuses for lack of HBM."""
  vocab_size = state_lib.model_vocab_size(config, accounting.task_vocab_size(config.data))
  start = time.perf_counter()
  try:
    # The special ids are constants of the program: the toy tokenizer's serve for any task.
    special_ids = models.SpecialIds.from_tokenizer(accounting.toy_tokenizer())
    report = aot.compile_config(config, devices, vocab_size=vocab_size, special_ids=special_ids,
                                programs=FLAGS.programs)
  except Exception as e:
    text = str(e)
    if 'RESOURCE_EXHAUSTED' not in text:
      raise
    # 'Ran out of memory on HBM, the total memory required for HLO temporaries (24.52G) exceeds
    # available HBM (15.75G).': the compiler's verdict, on the temporaries alone.
    sizes = re.findall(r'\(([\d.]+)([KMGT])\)', text.splitlines()[0])
    unit = {'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}
    need = float(sizes[0][0]) * unit[sizes[0][1]] if sizes else None
    raise DoesNotFit(need, text.splitlines()[0]) from None
  return aot.summary(config, devices, report, vocab_size), time.perf_counter() - start


def does_not_fit_line(need, devices, *, lower_bound=False):
  hbm = aot.hbm_bytes(devices[0])
  gen = aot.target_generation(devices[0])
  has = 'an unknown amount' if hbm is None else f'{hbm / aot.GiB:g}'
  return f'needs {"at least " if lower_bound else ""}{gib(need)} GiB per chip, {gen} has {has}'


def flops_text(flops):
  return 'n/a' if flops is None else f'{flops:.3g}'


def table(summary):
  """The per-program table of one compile, as markdown lines."""
  lines = ['| program | arguments | outputs | temp | aliased | total per chip | FLOPs per chip '
           '(XLA) | collectives | custom calls |', '|' + '---|' * 9]
  for name, r in summary['programs'].items():
    b = r['bytes']
    coll = ', '.join(f'{k} {v}' for k, v in r['collectives'].items() if v) or 'none'
    calls = ', '.join(f'{k} {v}' for k, v in r['custom_calls'].items()) or 'none'
    lines.append(f'| {name} | {accounting.human_bytes(b["argument"])} '
                 f'| {accounting.human_bytes(b["output"])} | {accounting.human_bytes(b["temp"])} | '
                 f'{accounting.human_bytes(b["alias"])} | **{accounting.human_bytes(b["total"])}** '
                 f'| {flops_text(r["flops"])} | {coll} | '
                 f'{calls} |')
  return lines


def describe(summary, name):
  mesh = ' x '.join(f'{a} {s}' for a, s in summary['mesh'].items() if s > 1) or 'one chip'
  hbm = summary['hbm_bytes']
  verdict = {True: 'fits', False: 'DOES NOT FIT', None: 'HBM unknown'}[summary['fits']]
  flops = summary['analytic_flops_per_chip']
  out = [f'# {name}: {summary["chips"]} x {summary["topology_kind"]} ({summary["generation"]}), '
         f'mesh {mesh}', ''] + table(summary) + ['']
  out.append(f'{verdict}: needs {accounting.human_bytes(summary["per_chip_bytes"])} '
             'per chip (the largest '
             f'program), {summary["generation"]} has '
             f'{"?" if hbm is None else gib(hbm)} GiB of HBM.')
  if flops and summary['flops_per_chip']:
    full = summary.get('analytic_flops_full_per_chip')
    out.append(f'Train step FLOPs per chip: XLA {summary["flops_per_chip"]:.4g}'
               f'{loops_text(summary)}, '
               f'models.accounting {flops:.4g} counted for the kernel (its score products over '
               'the tiles it visits)' + (f', {full:.4g} with full score matrices x3 (the MFU\'s '
               'count)' if full and abs(full / flops - 1) > 1e-3 else '') + '.')
  if summary.get('estimate'):
    what = 'train step' if 'train' in summary['programs'] else 'first program'
    out.append(estimate_line(summary['estimate'], what))
  return '\n'.join(out)


def loops_text(summary):
  """What the XLA count of a program with loops is (training.hlo_cost), or '' without loops."""
  runs = [n for n in summary.get('loops', {}).values() if n > 1]
  once = summary.get('flops_counted_once_per_chip')
  if not runs:
    return ''
  if not summary.get('loops_counted', True):
    return (' (each loop body counted once: the bodies\' costs could not be read, so the FLOPs '
            'and the estimate undercount the loops)')
  trips = ', '.join(f'{n}' for n in sorted(runs))
  return (f' (XLA\'s count with loop bodies times their trip counts: {len(runs)} '
          f'{"loop" if len(runs) == 1 else "loops"} of {trips} runs a step; {once:.4g} with each '
          'body once)')


def ms(seconds):
  return f'{seconds * 1e3:.3g} ms'


def estimate_line(e, what):
  """One line of a program's roofline estimate (training.roofline)."""
  mfu = '' if e['mfu'] is None else f', MFU {100 * e["mfu"]:.1f}% at that time'
  compiler = ('; libtpu\'s own estimate unavailable' if e.get('compiler_unavailable') else
              '' if e['compiler_s'] is None else f'; libtpu\'s own estimate {ms(e["compiler_s"])}')
  return (f'Estimated {what} (from the compiled program, not a measurement): {ms(e["step_s"])}, '
          f'bound by {e["bound"]} (compute {ms(e["compute_s"])}, memory {ms(e["memory_s"])}, '
          f'collectives {ms(e["collective_s"])} for '
          f'{accounting.human_bytes(e["collective_bytes"])} sent per chip; '
          f'{ms(e["serial_s"])} with nothing overlapped){mfu}{compiler}.')


def load_configs():
  """[(name, config or the ConfigError text)] of --config or of every cell of --sweep."""
  if FLAGS.sweep:
    path, arg = config_file.split_spec(FLAGS.sweep)
    try:
      module = sweep_spec.load_sweep_module(path)
      sweep = sweep_spec.get_sweep(module, arg)
      # One seed: the seed changes the parameters' values, not the program.
      cells = sweep_spec.expand(sweep, seeds=[str((sweep.get('seeds') or [0])[0])])
    except sweep_spec.SweepError as e:
      cli_checks.fail('config error', e)
    out = []
    for cell in cells:
      # A fine-tune's source run changes the parameters, not the program.
      cell = {**cell, 'overrides': {k: v for k, v in cell['overrides'].items()
                                    if k != 'train.init_from'}}
      name = cell['name'].rsplit(',seed=', 1)[0] or 'base'
      try:
        out.append((name, sweep_spec.cell_config(module, arg, cell)))
      except sweep_spec.SweepError as e:
        out.append((name, str(e)))
    return out
  if FLAGS.config is None:
    cli_checks.fail('aot', '--config or --sweep is required; e.g. --config=configs/decoder_only.py')
  config = validation.resolve(FLAGS.config.unlock())
  try:
    validation.validate(config)
  except options.ConfigError as e:
    cli_checks.fail('config error', e)
  return [(FLAGS['config'].config_filename, config)]


def _stop(signum, frame):
  """SIGTERM as Ctrl-C: the compiles end in `main`'s one line."""
  del frame
  raise KeyboardInterrupt(signum)


def main(argv):
  """The flags checked, then `compile_all`; a SIGINT or SIGTERM ends it in one line with
  128 + the signal's number and no report: a sweep's table of the cells compiled so far would read
  as the whole sweep's."""
  signal.signal(signal.SIGTERM, _stop)
  done = []  # the cells compiled so far
  try:
    _main(argv, done)
  except KeyboardInterrupt as e:
    signum = e.args[0] if e.args and isinstance(e.args[0], int) else signal.SIGINT
    print(f'aot: stopped by {signal.Signals(signum).name} after compiling {len(done)} '
          f'{"cell" if len(done) == 1 else "cells"}; no report was printed (it would be partial); '
          'rerun the same command', file=sys.stderr)
    sys.exit(128 + signum)


def _main(argv, done):
  logging.set_verbosity(logging.WARNING)  # jax logs at INFO that this host has no TPU backend
  if len(argv) > 1:
    cli_checks.fail('aot', f'unexpected arguments {argv[1:]}; valid: flags only')
  if not FLAGS.topology:
    cli_checks.fail('aot', '--topology is required; valid examples: '
                    f'{", ".join(aot.EXAMPLE_TOPOLOGIES)}')
  bad = [p for p in FLAGS.programs if p not in PROGRAMS]
  if bad:
    cli_checks.fail('aot', f'--programs={bad[0]!r} unknown; valid: {", ".join(PROGRAMS)}')
  try:
    devices = aot.topology_devices(FLAGS.topology)
  except aot.AotError as e:
    cli_checks.fail('aot', e)
  # The configs are validated, and the programs traced, for the target's backend: a kernel that
  # declares TPU only (`Kernel.platforms`) passes on this CPU host when the target is a TPU.
  with attention.compiling_for(devices[0].platform):
    compile_all(devices, done)


def compile_all(devices, results=None):
  """Compiles the config or the sweep's cells for `devices`, prints the report, exits.

  Args:
    devices: the target's devices.
    results: a list the (name, summary) of each cell is appended to as it compiles.
  """
  configs = load_configs()
  if FLAGS.mesh == 'search':
    if FLAGS.sweep:
      cli_checks.fail('aot', '--mesh=search takes one --config, not --sweep')
    search_main(configs[0][1], devices)
  if FLAGS.mesh == 'auto':
    configs = [(n, c if isinstance(c, str) else aot.auto_mesh(c, len(devices))) for n, c in configs]
  results, status = [] if results is None else results, 0
  for name, config in configs:
    if isinstance(config, str):
      results.append((name, {'error': config, 'status': 2}))
      continue
    try:
      if FLAGS.mesh == 'auto':
        validation.validate(config)  # the batch must divide over the new mesh
      summary, seconds = compile_one(config, devices)
      summary['compile_seconds'] = round(seconds, 1)
      if summary['fits'] is False:
        summary['status'] = 1
        summary['error'] = does_not_fit_line(summary['per_chip_bytes'], devices)
      results.append((name, summary))
    except (options.ConfigError, aot.AotError) as e:
      results.append((name, {'error': ' '.join(str(e).split()), 'status': 2}))
    except DoesNotFit as e:
      need, line = e.args
      results.append((name, {**aot.target(config, devices), 'status': 1, 'fits': False,
                             'per_chip_bytes': need, 'error': does_not_fit_line(
                                 need, devices, lower_bound=True) if need else line}))
    except Exception as e:  # noqa: BLE001
      # Any other compiler or lowering failure: one line, and the other cells still compile.
      first = (str(e).strip().splitlines() or [''])[0][:300]
      results.append((name, {'error': f'does not compile: {type(e).__name__}: {first}',
                             'status': 1}))
  for name, r in results:
    status = max(status, r.get('status', 0))
  if FLAGS.sweep:
    print(sweep_table(results, devices))
  else:
    (name, r), = results
    if 'programs' in r:
      print(describe(r, name))
    if r.get('error'):
      print(('config error: ' if r['status'] == 2 else 'aot: ') + r['error'], file=sys.stderr)
  if FLAGS.json:
    out = ({'topology': FLAGS.topology, 'cells': dict(results)} if FLAGS.sweep else results[0][1])
    print(json.dumps(out, sort_keys=True))
  sys.exit(status)


def sweep_table(results, devices):
  """One row per cell: mesh, GiB per chip against the HBM, fits, Mosaic kernels, compile time."""
  gen = aot.target_generation(devices[0])
  hbm = aot.hbm_bytes(devices[0])
  kernel = aot.KERNEL_CALLS.get(aot.lowering_platform(devices[0]))
  lines = [f'# {FLAGS.sweep} on {FLAGS.topology} ({len(devices)} x {gen}, '
           f'{"?" if hbm is None else gib(hbm)} GiB HBM per chip)', '',
           f'| cell | mesh | GiB per chip | fits | {kernel} calls | compile s |',
           '|---|---|---|---|---|---|']
  for name, r in results:
    if 'programs' not in r:
      lines.append(f'| {name} | | | {"no" if r.get("status") == 1 else "error"}: '
                   f'{r["error"]} | | |')
      continue
    mesh = ' x '.join(f'{a} {s}' for a, s in r['mesh'].items() if s > 1) or 'one chip'
    fits = {True: 'yes', False: 'no', None: 'HBM unknown'}[r['fits']]
    lines.append(f'| {name} | {mesh} | {gib(r["per_chip_bytes"])} | {fits} | '
                 f'{r["custom_calls"].get(kernel, 0)} | {r["compile_seconds"]} |')
  return '\n'.join(lines)


def mesh_candidates(config, chips):
  """Every mesh of `chips` over data, fsdp and tensor (and expert for an MoE), as dicts."""
  axes = ['data', 'fsdp', 'tensor'] + (['expert'] if config.model.get('moe_experts', 0) else [])
  meshes = [{}]
  for i, axis in enumerate(axes):
    last = i == len(axes) - 1
    meshes = [{**m, axis: d} for m in meshes
              for d in range(1, chips + 1)
              if chips % (math.prod(m.values()) * d) == 0
              and (not last or math.prod(m.values()) * d == chips)]
  return meshes


def search(config, devices):
  """[(mesh, summary or {'error', 'status'})] of every candidate mesh, the fitting ones first by
  estimated step time."""
  results = []
  for sizes in tqdm.tqdm(mesh_candidates(config, len(devices)), desc='meshes', leave=False,
                         disable=None):
    cell = config.copy_and_resolve_references()
    for axis in sharding.MESH_AXES:
      cell.mesh[axis] = sizes.get(axis, 1)
    try:
      validation.validate(cell)
      summary, _ = compile_one(cell, devices)
      if summary['fits'] is False:
        summary['error'] = does_not_fit_line(summary['per_chip_bytes'], devices)
    except validation.ConfigError as e:
      summary = {'error': f'config error: {" ".join(str(e).split())}'}
    except DoesNotFit as e:
      summary = {'error': does_not_fit_line(e.args[0], devices, lower_bound=True)
                 if e.args[0] else e.args[1]}
    except Exception as e:  # noqa: BLE001  (one mesh's compiler failure; the others still rank)
      first = (str(e).strip().splitlines() or [''])[0][:200]
      summary = {'error': f'does not compile: {type(e).__name__}: {first}'}
    results.append((sizes, summary))
  def key(item):
    e = item[1].get('estimate')
    return (bool(item[1].get('error')) or e is None, e['step_s'] if e else 0.0)
  return sorted(results, key=key)


def search_table(results):
  """The ranked meshes as markdown, with the reason each one loses to the first."""
  lines = ['| rank | mesh | GiB per chip | estimated step | bound | MFU | why not first |',
           '|---|---|---|---|---|---|---|']
  best = results[0][1].get('estimate') if results else None
  for rank, (sizes, r) in enumerate(results, 1):
    mesh = ' x '.join(f'{a} {s}' for a, s in sizes.items() if s > 1) or 'one chip'
    e = r.get('estimate')
    if r.get('error') or not e:
      lines.append(f'| - | {mesh} | | | | | {r.get("error") or "no estimate for this chip"} |')
      continue
    why = ('' if rank == 1 else
           f'{e["step_s"] / best["step_s"]:.2f}x the first\'s step, bound by {e["bound"]} '
           f'({ms(e[e["bound"] + "_s"])} against the first\'s {ms(best[e["bound"] + "_s"])})')
    mfu = '' if e['mfu'] is None else f'{100 * e["mfu"]:.1f}%'
    lines.append(f'| {rank} | {mesh} | {gib(r["per_chip_bytes"])} | {ms(e["step_s"])} | '
                 f'{e["bound"]} | {mfu} | {why} |')
  return '\n'.join(lines)


def search_main(config, devices):
  """Prints the ranked meshes (and the JSON with --json); exits 0 when one fits, else 1."""
  results = search(config, devices)
  print(f'# every mesh of {len(devices)} x {aot.target_generation(devices[0])} for '
        f'{FLAGS["config"].config_filename}, ranked by estimated step time (estimates from the '
        'compiled programs, not measurements)\n')
  print(search_table(results))
  if FLAGS.json:
    print(json.dumps({'topology': FLAGS.topology, 'meshes': [
        {'mesh': sizes, **{k: v for k, v in r.items() if k != 'programs'}}
        for sizes, r in results]}, sort_keys=True))
  sys.exit(0 if results and not results[0][1].get('error') else 1)


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=cli_checks.flags_parser('aot'))
