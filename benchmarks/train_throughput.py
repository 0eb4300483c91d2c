"""Training throughput and MFU of train.py's step on this machine, against a plain-JAX
reference step.

    .venv/bin/python benchmarks/train_throughput.py [--steps=4] [--rounds=5] [--dropout=0,0.1]
        [--sizes=a,b] [--host_malloc=tuned,default] [--json]

For each size below ((a) and (b)), times the jitted `training.steps.train_step` on random tokens
(no input pipeline: the step alone) and, in the same process, a reference step written in this file
with no attnlab code (`reference_*`: plain JAX einsums and optax), the same model as attnlab's
default config at that size: decoder-only, Pre-LN with LayerNorm (scale and shift, epsilon 1e-6)
and a final LayerNorm, token embedding x sqrt(D) plus sinusoidal positions, causal softmax attention
over the full T x T scores, a ReLU FFN, no biases in the projections, the output projection tied to
the embedding, dropout on the embeddings and every sublayer output, float32 cross-entropy and
argmax accuracy, and optax AdamW after global-norm clipping with training.state.make_optimizer's
schedule and hyperparameters. The two alternate: `--rounds` rounds, each timing `--steps` steps of
one then the other (the order swapped every round), so the load of a shared machine falls on both
alike; tokens/s is each one's median over the rounds, `vs reference` their ratio, and `per round`
the range of the ratios of the rounds' back-to-back pairs (the noise). It prints
tokens/s and the model FLOPs utilisation

    MFU = 3 · (forward FLOPs per token) · tokens/s
          / (float32 matmul FLOP/s measured in the same run)

with the forward FLOPs of `models.accounting.forward_flops` (the count `python -m tools.accounting`
prints and tests against XLA's cost analysis): every weight matmul including the tied D x V output
projection, plus the full T x T attention scores QK^T and PV, i.e. PaLM appendix B's 6·N + 12·L·T·D
with N the parameters that take part in a matmul (as nanoGPT counts them). The peak is the best of
five rounds of a 2048³ float32 matmul jitted on all cores. Each `--host_malloc` setting runs in its
own process (glibc reads the arena limit before threads start): 'tuned' is `host.tune_host_malloc`,
what train.py applies, 'default' glibc as it comes. Run it alone: the numbers are a share of this
machine, so any other load lowers them (the ratio to the reference much less: it comes
from one run).
`--json` prints one JSON object per row instead of the table.
"""

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import optax

from configs import default
from training import validation
from models import accounting
from training import host
from training import state as state_lib
from training import steps as steps_lib

_STEPS = flags.DEFINE_integer('steps', 4, 'Timed steps per round and step (after 2 warm-up steps).')
_ROUNDS = flags.DEFINE_integer('rounds', 5,
                               'Alternating rounds of attnlab\'s step and the reference.')
_JSON = flags.DEFINE_bool('json', False, 'Print one JSON object per row instead of the table.')
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


# --- The reference: a plain-JAX Pre-LN decoder and AdamW step, no attnlab code -------------------


def reference_init(key, vocab, num_layers, d, num_heads, d_ff):
  """Parameters of the reference decoder (scaled normal init; the values do not affect speed)."""
  h = d // num_heads
  keys = iter(jax.random.split(key, 1 + 6 * num_layers))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(fan_in)

  def norm():
    return {'scale': jnp.ones((d,), jnp.float32), 'bias': jnp.zeros((d,), jnp.float32)}

  layers = [{'ln1': norm(), 'wq': normal((d, num_heads, h), d), 'wk': normal((d, num_heads, h), d),
             'wv': normal((d, num_heads, h), d), 'wo': normal((num_heads, h, d), d), 'ln2': norm(),
             'wi': normal((d, d_ff), d), 'wf': normal((d_ff, d), d_ff)} for _ in range(num_layers)]
  return {'embed': normal((vocab, d), d), 'layers': layers, 'ln_f': norm()}


def reference_layer_norm(x, p):
  """LayerNorm over D as flax's computes it: Var = E[x²] - E[x]², clipped at 0, epsilon 1e-6.

  Written with the two-pass variance E[(x - E[x])²] instead, the (a) step ran 1.6x slower: XLA:CPU
  then fuses the backward pass's residual-gradient sums into every consumer, re-adding all later
  layers' terms each time (fusions of up to 119 operands at 6 layers; 9 with this form).
  """
  sq = jnp.square(x)  # [B, T, D]
  mean = jnp.mean(x, -1, keepdims=True)  # [B, T, 1]
  var = jnp.maximum(jnp.mean(sq, -1, keepdims=True) - jnp.square(mean), 0.0)
  return (x - mean) * (jax.lax.rsqrt(var + 1e-6) * p['scale']) + p['bias']


def reference_dropout(x, rate, key):
  if rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def reference_loss(params, batch, key, rate):
  """(mean cross-entropy, (summed loss, summed correct)) of the reference decoder."""
  tokens, targets, weights = batch['inputs'], batch['targets'], batch['weights']
  b, t = tokens.shape
  d = params['embed'].shape[1]
  keys = iter(jax.random.split(key, 1 + 2 * len(params['layers'])))
  inv_freq = 10000.0 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [D/2]
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq  # [T, D/2]
  pos = jnp.stack([jnp.sin(angles), jnp.cos(angles)], -1).reshape(t, d)  # [T, D]
  x = params['embed'][tokens] * math.sqrt(d) + pos  # [B, T, D]
  x = reference_dropout(x, rate, next(keys))
  causal = jnp.tril(jnp.ones((t, t), bool))  # [T, S]
  for p in params['layers']:
    y = reference_layer_norm(x, p['ln1'])
    q, k, v = (jnp.einsum('BTD,DNH->BTNH', y, p[w]) for w in ('wq', 'wk', 'wv'))  # [B, T, N, H]
    scores = jnp.einsum('BTNH,BSNH->BNTS', q, k) / math.sqrt(q.shape[-1])  # [B, N, T, S]
    probs = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(jnp.float32).min), -1)
    y = jnp.einsum('BNTS,BSNH->BTNH', probs, v)  # [B, T, N, H]
    x = x + reference_dropout(jnp.einsum('BTNH,NHD->BTD', y, p['wo']), rate, next(keys))
    y = jax.nn.relu(reference_layer_norm(x, p['ln2']) @ p['wi']) @ p['wf']  # [B, T, D]
    x = x + reference_dropout(y, rate, next(keys))
  x = reference_layer_norm(x, params['ln_f'])
  logits = jnp.einsum('BTD,VD->BTV', x, params['embed'])  # [B, T, V], tied
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]  # [B, T]
  ce = jax.nn.logsumexp(logits, -1) - target_logit  # [B, T]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
  loss_sum = jnp.sum(ce * weights)
  return loss_sum / jnp.maximum(jnp.sum(weights), 1.0), (loss_sum, jnp.sum(correct * weights))


def reference_optimizer(t):
  """optax AdamW after global-norm clipping, warmup then cosine decay (the numbers of `t` only)."""
  schedule = optax.cosine_decay_schedule(t.learning_rate, t.steps - t.warmup_steps)
  if t.warmup_steps:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps), schedule], [t.warmup_steps])
  return optax.chain(optax.clip_by_global_norm(t.grad_clip_norm),
                     optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay))


def reference_step(tx, rate, base_key, state, batch):
  """One reference training step: (new state, (summed loss, summed correct))."""
  params, opt_state, step = state
  grad_fn = jax.value_and_grad(reference_loss, has_aux=True)
  (_, sums), grads = grad_fn(params, batch, jax.random.fold_in(base_key, step), rate)
  updates, opt_state = tx.update(grads, opt_state, params)
  return (optax.apply_updates(params, updates), opt_state, step + 1), sums


# --- Timing ---------------------------------------------------------------------------------------


def timed(step, state, batch, steps):
  """(seconds for `steps` steps, the state after them)."""
  start = time.perf_counter()
  for _ in range(steps):
    state, sums = step(state, batch)
  jax.block_until_ready(sums)
  return time.perf_counter() - start, state


# The config the reference reproduces: attnlab's defaults (configs/default.py) at the sizes above.
REFERENCE_MODEL = {'arch': 'decoder_only', 'attention': 'dense', 'attention_impl': 'xla',
                   'position': 'sinusoidal', 'norm': 'layernorm', 'norm_position': 'pre',
                   'ffn': 'relu', 'use_bias': False, 'scan_layers': False}


def time_steps(config, steps, rounds):
  """Median tokens/s of attnlab's step and of the reference over alternating rounds."""
  m, t = config.model, config.train
  differ = {k: m[k] for k, v in REFERENCE_MODEL.items() if m[k] != v}
  if differ or m.num_kv_heads != m.num_heads or t.schedule != 'cosine' or t.grad_clip_norm <= 0:
    raise ValueError(f'the reference step implements {REFERENCE_MODEL}, MHA, cosine schedule and '
                     f'clipping; this config differs: {differ}')
  graphdef, tx, state = state_lib.create_state(config, VOCAB)
  flops_per_token = model_flops_per_token(config)
  b, length = t.batch_size, config.data.max_length
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, VOCAB, (b, length + 1)).astype(np.int32)
  batch = jax.device_put({'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
                          'weights': np.ones((b, length), np.float32)})
  step = jax.jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0)),
                 donate_argnums=(0,))
  ref_tx = reference_optimizer(t)
  ref_params = reference_init(jax.random.key(0), VOCAB, m.num_layers, m.d_model, m.num_heads,
                              m.d_ff)
  ref_state = (ref_params, ref_tx.init(ref_params), jnp.zeros((), jnp.int32))
  ref_step = jax.jit(functools.partial(reference_step, ref_tx, float(m.dropout), jax.random.key(0)),
                     donate_argnums=(0,))
  _, state = timed(step, state, batch, 2)  # compile and warm up
  _, ref_state = timed(ref_step, ref_state, batch, 2)
  ours, theirs = [], []
  for r in range(rounds):
    for which in ((0, 1) if r % 2 == 0 else (1, 0)):
      if which == 0:
        seconds, state = timed(step, state, batch, steps)
        ours.append(b * length * steps / seconds)
      else:
        seconds, ref_state = timed(ref_step, ref_state, batch, steps)
        theirs.append(b * length * steps / seconds)
  return statistics.median(ours), statistics.median(theirs), flops_per_token, ours, theirs


def time_rows(peak, malloc):
  """The table rows of every size and dropout rate, in this process."""
  for size in _SIZES.value:
    layers, d, heads, d_ff, length, batch = SIZES[size]
    for dropout in _DROPOUT.value:
      tok_s, ref_s, fpt, ours, theirs = time_steps(make_config(size, dropout), _STEPS.value,
                                                   _ROUNDS.value)
      per_step = batch * length / tok_s
      if _JSON.value:
        print(json.dumps({
            'size': size, 'dropout': float(dropout), 'tokens_per_s': tok_s,
            'reference_tokens_per_s': ref_s, 'mfu': fpt * tok_s / peak, 'malloc': malloc,
            'ratio': tok_s / ref_s, 'reference_mfu': fpt * ref_s / peak, 'peak_flops': peak,
            'rounds_tokens_per_s': [round(x, 1) for x in ours],
            'reference_rounds_tokens_per_s': [round(x, 1) for x in theirs]}), flush=True)
        continue
      per_round = [a / b for a, b in zip(ours, theirs)]  # each round's pair, run back to back
      print(f'| ({size}) | {layers} x {d}, {heads}, {d_ff}, {length}, {batch} | {fpt / 1e6:.1f} M '
            f'| {dropout} | {malloc} | {per_step:.3f} | {tok_s:,.0f} | {fpt * tok_s / 1e9:.1f} '
            f'| {fpt * tok_s / peak:.2f} | {ref_s:,.0f} | {fpt * ref_s / peak:.2f} '
            f'| {tok_s / ref_s:.3f}x | {min(per_round):.2f}-{max(per_round):.2f} |', flush=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _PEAK.value:  # a child: one malloc setting, already applied before JAX started
    time_rows(_PEAK.value, _MALLOC.value[0])
    return
  peak = matmul_flops_per_sec()
  if not _JSON.value:
    print(f'float32 matmul peak (2048^3, jitted, best of 5, {os.cpu_count()} cores): '
          f'{peak / 1e9:.1f} GFLOP/s; {_ROUNDS.value} alternating rounds of {_STEPS.value} steps, '
          'medians')
    print('MFU = 3 · forward FLOPs per token (models.accounting: weight matmuls incl. the D x V '
          'output, full attention scores) · tokens/s / peak\n')
    print('| size | layers x d_model, heads, d_ff, T, B | training FLOPs/token | dropout | malloc '
          '| s/step | tokens/s | model GFLOP/s | MFU | reference tokens/s | reference MFU '
          '| vs reference | per round |')
    print('|---|---|---|---|---|---|---|---|---|---|---|---|---|')
  for malloc in _MALLOC.value:
    child = [a for a in sys.argv[1:] if not a.startswith(('--host_malloc', '--peak'))]
    subprocess.run([sys.executable, os.path.abspath(__file__), *child, f'--host_malloc={malloc}',
                    f'--peak={peak}'], check=True)


if __name__ == '__main__':
  if '--host_malloc=tuned' in sys.argv and any(a.startswith('--peak=') for a in sys.argv):
    host.tune_host_malloc()  # before JAX starts its threads
  app.run(main)
