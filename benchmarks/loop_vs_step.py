"""train.py end to end against its jitted step alone, on the same shapes and batches, in one run.

    .venv/bin/python benchmarks/loop_vs_step.py [--sizes=a,b] [--rounds=2] [--json]

For each size (benchmarks/train_throughput.py's (a) and (b): layers, d_model, heads, d_ff, T, B) on
the toy dataset (`configs/decoder_only.py`, vocabulary 166, `data.packing=stream` so that every row
is full of real tokens, diagnostics off, no warmup) two processes alternate, each round in swapped
order:

- loop: `python train.py` for `window x (windows + 1)` steps with `train.log_every=window`; the
  first log row's window holds the compilation and is dropped, the others are the tokens_per_sec
  train.py writes to metrics.jsonl (real tokens of the host batches over the window's wall time:
  reading, placing, dispatching the steps and the log step's one wait for the device). Evaluation
  and checkpoints come only after the last step (train.eval_every, checkpoint_every beyond it).
- step: this file with `--child=SIZE`, the same resolved config, malloc tuned as train.py does on a
  CPU host (`training.host.tune_host_malloc` before JAX starts), the same `training.state.
  create_state` and `training.steps.train_step` jitted with the state donated, on batches taken
  from `data.pipeline` with the loop's config and seed (placed on the device before timing), timed
  over the same windows of `window` steps after two warm-up steps; tokens counted as the loop
  counts them (`training.steps.count_tokens`).

The table gives each one's median over its windows and rounds and their ratio (the target:
the loop at >= 0.95x the step).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name -> (num_layers, d_model, num_heads, d_ff, length, batch, log window in steps, windows timed)
SIZES = {'a': (6, 512, 8, 2048, 256, 8, 4, 3), 'b': (2, 128, 4, 512, 128, 32, 40, 4)}


def overrides(size, steps):
  """The --config.FIELD=VALUE flags of a size, for train.py and for the step child alike."""
  layers, d, heads, d_ff, length, batch, window, _ = SIZES[size]
  return {'model.num_layers': layers, 'model.d_model': d, 'model.num_heads': heads,
          'model.d_ff': d_ff, 'data.max_length': length, 'data.packing': 'stream',
          'train.batch_size': batch, 'train.steps': steps, 'train.log_every': window,
          'train.warmup_steps': 0, 'train.diagnostics': False,
          'train.eval_every': steps + 1000, 'train.checkpoint_every': steps + 1000}


def total_steps(size):
  window, windows = SIZES[size][6:]
  return window * (windows + 1)


def run_loop(size, workdir):
  """The tokens/s of train.py's log windows after the first (which holds the compilation)."""
  args = [f'--config.{k}={v}' for k, v in overrides(size, total_steps(size)).items()]
  subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'),
                  f'--config={os.path.join(ROOT, "configs", "decoder_only.py")}',
                  f'--workdir={workdir}', *args], check=True, cwd=ROOT,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  train = [r for r in rows if r['split'] == 'train']
  return [r['tokens_per_sec'] for r in train[1:]]


def run_step(size):
  """The tokens/s of the step alone over the same windows (a child process of this file)."""
  out = subprocess.run([sys.executable, os.path.abspath(__file__), f'--child={size}'], check=True,
                       cwd=ROOT, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def child(size):
  """In a fresh process: time the jitted step on the loop's batches; print the windows' tokens/s."""
  from training import host
  host.tune_host_malloc()  # before JAX starts its threads, as train.py on a CPU host
  import functools
  import jax
  from configs import decoder_only
  from data import pipeline
  import models
  from training import state as state_lib
  from training import steps as steps_lib
  from training import validation

  config = decoder_only.get_config()
  for key, value in overrides(size, total_steps(size)).items():
    group, field = key.split('.')
    config[group][field] = value
  config = validation.resolve(config)
  validation.validate(config)
  t = config.train
  window, windows = SIZES[size][6:]
  tokenizer = pipeline.get_tokenizer(config.data)
  it = pipeline.make_iterator(config.data, 'train', t.batch_size, batch_format='next_token',
                              loss_on=t.loss_on, seed=t.seed)
  host_batches = [next(it) for _ in range(2 + window * windows)]  # the loop's first batches
  tokens = [steps_lib.count_tokens(b) for b in host_batches]
  batches = [jax.device_put(b) for b in host_batches]
  graphdef, tx, state = state_lib.create_state(
      config, tokenizer.vocab_size, special_ids=models.SpecialIds.from_tokenizer(tokenizer))
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(t.seed)),
                 donate_argnums=(0,))
  for batch in batches[:2]:  # compile and warm up
    state, sums = step(state, batch)
  jax.block_until_ready(sums)
  out = []
  for w in range(windows):
    lo = 2 + w * window
    start = time.perf_counter()
    for batch in batches[lo:lo + window]:
      state, sums = step(state, batch)
    jax.block_until_ready(sums)
    out.append(sum(tokens[lo:lo + window]) / (time.perf_counter() - start))
  print(json.dumps({'vocab': tokenizer.vocab_size, 'tokens_per_sec': out}))


def main(argv):
  flags = dict(a.lstrip('-').split('=', 1) for a in argv[1:] if '=' in a)
  as_json = '--json' in argv[1:]
  if 'child' in flags:
    child(flags['child'])
    return
  sizes = flags.get('sizes', 'a,b').split(',')
  rounds = int(flags.get('rounds', 2))
  loop_runs = {s: [] for s in sizes}
  step_runs = {s: [] for s in sizes}
  vocab = None
  started = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix='loop_vs_step_') as tmp:
    for r in range(rounds):
      for size in sizes:
        for which in (('loop', 'step') if r % 2 == 0 else ('step', 'loop')):
          if which == 'loop':
            loop_runs[size].append(run_loop(size, os.path.join(tmp, f'{size}_{r}')))
          else:
            result = run_step(size)
            vocab = result['vocab']
            step_runs[size].append(result['tokens_per_sec'])
          latest = (loop_runs if which == 'loop' else step_runs)[size][-1]
          print(f'round {r + 1}/{rounds} ({size}) {which}: '
                f'{", ".join(f"{x:,.0f}" for x in latest)}'
                f' tokens/s ({time.perf_counter() - started:.0f} s)', file=sys.stderr, flush=True)
  rows = []
  for size in sizes:
    layers, d, heads, d_ff, length, batch, window, windows = SIZES[size]
    loop_all = [x for run in loop_runs[size] for x in run]
    step_all = [x for run in step_runs[size] for x in run]
    rows.append({'size': size, 'shape': f'{layers} x {d}, {heads}, {d_ff}, {length}, {batch}',
                 'vocab': vocab, 'window_steps': window, 'windows': len(loop_all),
                 'loop_tokens_per_s': statistics.median(loop_all),
                 'step_tokens_per_s': statistics.median(step_all),
                 'ratio': statistics.median(loop_all) / statistics.median(step_all),
                 'loop_windows': [round(x) for x in loop_all],
                 'step_windows': [round(x) for x in step_all]})
  if as_json:
    for row in rows:
      print(json.dumps(row))
    return
  print(f'train.py (configs/decoder_only.py, toy data, vocabulary {vocab}, packing=stream, '
        f'diagnostics off) vs its jitted step alone; {rounds} alternating rounds; medians over '
        'the log windows (compilation dropped)\n')
  print('| size | layers x d_model, heads, d_ff, T, B | steps per window | windows | train.py '
        'tokens/s | step alone tokens/s | loop / step | train.py windows | step windows |')
  print('|---|---|---|---|---|---|---|---|---|')
  for row in rows:
    print(f'| ({row["size"]}) | {row["shape"]} | {row["window_steps"]} | {row["windows"]} '
          f'| {row["loop_tokens_per_s"]:,.0f} | {row["step_tokens_per_s"]:,.0f} '
          f'| {row["ratio"]:.3f} | {", ".join(f"{x:,}" for x in row["loop_windows"])} '
          f'| {", ".join(f"{x:,}" for x in row["step_windows"])} |')


if __name__ == '__main__':
  main(sys.argv)
