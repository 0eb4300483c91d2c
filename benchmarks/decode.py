"""Decoding benchmark: KV-cache generation vs rerunning the full forward each token; cache bytes.

  python -m benchmarks.decode [--new_tokens=256] [--batch=8]

Prints a markdown table: seconds to generate `new_tokens` greedily on a small decoder-only model
with the cache (`models.decoding.generate`) and without (the full causal forward over the whole
buffer every step, `models.decoding.greedy_translate(use_cache=False)`), and the cache size of
MHA, GQA and MQA beside the formula 2 x layers x kv_heads x head_dim x length x bytes.
"""

import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import default
from training import validation
from models import decoding
import models

_NEW = flags.DEFINE_integer('new_tokens', 256, 'Tokens generated per row.')
_BATCH = flags.DEFINE_integer('batch', 8, 'Rows decoded together.')
_REPEATS = flags.DEFINE_integer('repeats', 1, 'Timed runs (the best is reported).')
VOCAB = 64
PROMPT = 8


def small_config(num_heads=8, num_kv_heads=8):
  config = validation.resolve(default.get_config())
  config.model.update(arch='decoder_only', num_layers=4, d_model=256, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, d_ff=1024, position='sinusoidal')
  return config.model


def best_time(fn, repeats):
  fn()  # compile
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return min(times)


def main(argv):
  del argv
  new, batch = _NEW.value, _BATCH.value
  length = PROMPT + new
  model = models.build(small_config(), VOCAB, length, rngs=nnx.Rngs(0))
  prompts = np.random.default_rng(0).integers(5, VOCAB, (batch, PROMPT)).tolist()
  # eos_id -1 never occurs: every row generates all `new` tokens in both paths.
  run = lambda use_cache: decoding.greedy_translate(  # noqa: E731
      model, prompts, length=length, max_new=new, eos_id=-1, batch_size=batch,
      use_cache=use_cache)
  same = run(True) == run(False)
  t_cache = best_time(lambda: run(True), _REPEATS.value)
  t_full = best_time(lambda: run(False), _REPEATS.value)
  print(f'backend {jax.default_backend()}, {jax.device_count()} device(s); decoder-only 4 layers, '
        f'd_model 256, 8 heads, vocab {VOCAB}; batch {batch}, prompt {PROMPT}, {new} new tokens')
  print()
  print('| decoding | seconds | tokens/s | speed-up |')
  print('|---|---:|---:|---:|')
  print(f'| full forward each step | {t_full:.2f} | {batch * new / t_full:.0f} | 1.0x |')
  print(f'| KV cache | {t_cache:.2f} | {batch * new / t_cache:.0f} | {t_full / t_cache:.1f}x |')
  print(f'\nsame tokens with and without the cache: {same}')
  print()
  print('| attention | N | K | head_dim | cache elements (per row) | formula 2·L·K·H·S | bytes '
        '(float32) |')
  print('|---|---:|---:|---:|---:|---:|---:|')
  for name, k in (('MHA', 8), ('GQA', 2), ('MQA', 1)):
    cfg = small_config(8, k)
    m = nnx.eval_shape(lambda cfg=cfg: models.build(cfg, VOCAB, length, rngs=nnx.Rngs(0)))
    shapes = jax.eval_shape(lambda m=m: m.init_cache({'inputs': jnp.zeros((1, 1))}, length))
    elements = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes['self']))
    h = cfg.d_model // cfg.num_heads
    formula = 2 * cfg.num_layers * k * h * length
    print(f'| {name} | 8 | {k} | {h} | {elements:,} | 2·{cfg.num_layers}·{k}·{h}·{length} = '
          f'{formula:,} | {4 * elements:,} |')


if __name__ == '__main__':
  app.run(main)
