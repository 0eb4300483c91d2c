"""Shared by the tests: quick configs, training hooks, metrics readers and synthetic workdirs."""

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from training import writers
from configs import decoder_only
from configs import default
from training import validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quick_config(data_dir, **train_overrides):
  """The validated `decoder_only.py:quick` config reading data from `data_dir`."""
  config = validation.resolve(decoder_only.get_config('quick'))
  config.data.data_dir = str(data_dir)
  config.train.update(train_overrides)
  validation.validate(config)
  return config


def interrupt_after(step):
  """A training hook that raises KeyboardInterrupt after `step`, as a kill would (no save)."""
  def hook(s, state):
    del state
    if s == step:
      raise KeyboardInterrupt(f'test interruption after step {step}')
  return hook


def sigterm_after(step):
  """A training hook that sends this process SIGTERM after `step` (a preemption notice)."""
  def hook(s, state):
    del state
    if s == step:
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


def metric_rows(workdir, split='train'):
  """The metrics.jsonl rows of `split`, in order."""
  rows = writers.read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  return [r for r in rows if r['split'] == split]


def tiny(length=64, **model):
  """The validated `default.py:size=tiny` config (L 2, D 64, N 4, F 256) at `length`."""
  config = default.get_config('size=tiny')
  config.data.max_length = length
  config.model.update(model)
  validation.resolve(config)
  validation.validate(config)
  return config


def tiny_config(**model):
  config = validation.resolve(decoder_only.get_config('quick'))
  config.model.update(num_layers=3, d_model=32, num_heads=4, d_ff=64, **model)
  config.train.diagnostics = True
  return validation.resolve(config)


def write_run(workdir, train, valid=(), *, steps=100, seed=0, fields=None, entropy=None,
              num_params=1000):
  """A synthetic workdir: train/valid [(step, loss)], config.json, run_info.json."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'metrics.jsonl'), 'w') as f:
    for step, loss in train:
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': loss,
                          'tokens_per_sec': 1000.0 + step}) + '\n')
    for step, loss in valid:
      f.write(json.dumps({'step': step, 'split': 'valid', 'loss': loss}) + '\n')
  config = {'train': {'steps': steps, 'seed': seed}, 'model': dict(fields or {})}
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(config, f)
  info = {'num_params': num_params}
  if entropy is not None:
    info['unigram_entropy'] = entropy
  with open(os.path.join(workdir, 'run_info.json'), 'w') as f:
    json.dump(info, f)



# XLA options for a quick compile rather than a quick run (quick_jit).
QUICK_COMPILE = {'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True,
                 'xla_cpu_use_fusion_emitters': False}


def quick_jit(fn, **jit_kwargs):
  """`jax.jit(fn)` compiled for a quick compile rather than a quick run: without LLVM's optimisation
  passes, and with XLA:CPU's elemental emitters instead of its MLIR fusion emitters (half the
  compile time of these programs). The unit tests compare numbers of tiny models and kernels, run
  once, so compiling was most of their run time. Jitting a whole check also compiles it once
  instead of once per eager op (the CPU is slow and shared)."""
  import jax
  return jax.jit(fn, compiler_options=QUICK_COMPILE, **jit_kwargs)


def jitted_forward(model):
  """`model(batch)` as `f(batch)`, one quick_jit program of the model's current state: one
  compilation per batch shape (shared by models of the same structure) instead of one per eager
  op."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  return functools.partial(_jitted_apply(graphdef), state)


@functools.lru_cache(maxsize=None)
def _jitted_apply(graphdef):
  from flax import nnx
  return quick_jit(lambda state, batch: nnx.merge(graphdef, state)(batch))


def one_block_reference(enc, tokens, attention):
  """A one-block Pre-LN `models.stack.Stack`'s output for `tokens` [1, T], computed around a
  reference attention: `attention(block.self_attention, x)` gets the normed row (float64, [T, D])
  and returns the attention sublayer's output; the rest reuses the model's own layers (embedding
  times sqrt(D), x + attn(norm(x)), x + ffn(norm(x)), the final norm)."""
  import jax.numpy as jnp
  import numpy as np
  blk = enc.blocks[0]
  x = np.asarray(enc.embed(tokens)[0] * np.sqrt(enc.embed.features), np.float64)
  x = x + attention(blk.self_attention, np.asarray(blk.self_norm(x), np.float64))
  x = x + np.asarray(blk.ffn(blk.ffn_norm(jnp.asarray(x, jnp.float32))), np.float64)
  return enc.final_norm(jnp.asarray(x, jnp.float32))

# The GCS emulator (gcp-storage-emulator, from the test extras) as a process, with three departures
# from real GCS mended: its HTTP server answers one request at a time with a listen queue of 5, and
# tensorstore opens many connections at once (a longer queue keeps them from being refused); its
# media downloads lack the x-goog-generation header that GCS sends and tensorstore's OCDBT needs
# for its conditional manifest writes ('Malformed StorageGeneration' without it); it ignores the
# ifGenerationMatch precondition of uploads and deletes, which the gs:// workdir lock relies on
# (412 when the object's generation differs, 0 meaning absent). The handlers are wrapped before
# the server's routes are built from them. On disk (`-d DIR`, to outlive a kill of the
# emulator), each file is written to a temporary file in a folder beside the store
# (DIR/.cloudstorage.writing) and renamed in: a kill mid-write leaves its index (.meta, rewritten
# at every object write) whole, as GCS keeps its objects, and no object's name can meet a
# temporary one. With GCS_DIE_AT_ENV set to 'BUCKET/PREFIX', the emulator exits with status
# GCS_DIED as it is about to write the first object whose path starts so (the store lost at a
# chosen moment of a run).
GCS_DIE_AT_ENV, GCS_DIED = 'ATTNLAB_TEST_GCS_DIE_AT', 86
GCS_LAUNCHER = """
import http, http.server, os, sys, tempfile
from gcp_storage_emulator import storage
from gcp_storage_emulator.handlers import objects
_write_bytes = storage._FileStore.write_bytes
DIE_AT = os.environ.get('%s')
def write_bytes(self, rel, content):
  if DIE_AT and self._norm(rel).startswith(DIE_AT):
    os._exit(%d)
  if self._root is None:
    return _write_bytes(self, rel, content)
  # Written in a folder beside the store, where no object's file can be, then renamed in.
  writing = self._root.parent / (self._root.name + '.writing')
  writing.mkdir(exist_ok=True)
  fd, temp = tempfile.mkstemp(dir=writing)
  with os.fdopen(fd, 'wb') as f:
    f.write(content)
  path = self._disk_path(rel)
  path.parent.mkdir(parents=True, exist_ok=True)
  os.replace(temp, path)
storage._FileStore.write_bytes = write_bytes
http.server.HTTPServer.request_queue_size = 256
_download = objects.download
def download(request, response, storage, *args, **kwargs):
  _download(request, response, storage, *args, **kwargs)
  try:
    obj = storage.get_file_obj(request.params['bucket_name'], request.params['object_id'])
    response['x-goog-generation'] = obj['generation']
  except Exception:  # not found: the handler set 404
    pass
objects.download = download
def _generation(storage, request):
  name = request.params.get('object_id') or request.query.get('name', [None])[0]
  if name is None and isinstance(request.data, dict):  # multipart: the name in the metadata
    name = request.data.get('meta', request.data).get('name')
  try:
    return int(storage.get_file_obj(request.params['bucket_name'], name)['generation'])
  except Exception:  # absent
    return 0
def conditional(handler):
  def checked(request, response, storage, *args, **kwargs):
    match = request.query.get('ifGenerationMatch')
    if match and int(match[0]) != _generation(storage, request):
      response.status = http.HTTPStatus.PRECONDITION_FAILED
      return
    return handler(request, response, storage, *args, **kwargs)
  return checked
objects.insert, objects.delete = conditional(objects.insert), conditional(objects.delete)
from gcp_storage_emulator.__main__ import main
sys.exit(main())
""" % (GCS_DIE_AT_ENV, GCS_DIED)


def start_gcs_emulator(port, storage=None, die_at=None):
  """The GCS emulator process on 127.0.0.1:`port` with the bucket `bucket`, once it answers: in
  memory, or with its objects under the folder `storage` (kept across a kill and a restart). With
  `die_at` ('bucket/PREFIX'), it exits with status GCS_DIED as it is about to write the first
  object whose path starts so."""
  where = ['-d', str(storage)] if storage else []
  env = {**os.environ, GCS_DIE_AT_ENV: die_at} if die_at else None
  proc = subprocess.Popen(
      [sys.executable, '-c', GCS_LAUNCHER, *where, 'start', f'--port={port}', '--host=127.0.0.1',
       '--default-bucket=bucket', '-q', *([] if storage else ['--in-memory'])],
      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
  deadline = time.time() + 60
  while True:  # until it answers
    try:
      urllib.request.urlopen(f'http://127.0.0.1:{port}/storage/v1/b', timeout=2).read()
      return proc
    except OSError:
      if proc.poll() is not None or time.time() > deadline:
        proc.kill()
        proc.wait()
        raise RuntimeError(f'the GCS emulator did not start (exit {proc.poll()})') from None
      time.sleep(0.2)


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def gcs_env(url, **extra_env):
  """The environment that points google-cloud-storage and gcsfs (hence etils.epath) at the emulator
  at `url` (STORAGE_EMULATOR_HOST), plus `extra_env` ('{url}' in a value is replaced)."""
  # gcsfs would ask the storage-control API (not emulated) whether the bucket is hierarchical.
  return {'STORAGE_EMULATOR_HOST': url, 'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false',
          **{k: v.format(url=url) for k, v in extra_env.items()}}


@contextlib.contextmanager
def gcs_emulator(**extra_env):
  """An in-memory GCS emulator on loopback with the bucket `bucket`; yields its URL.

  While it runs, os.environ is updated with `gcs_env(url, **extra_env)`; it is restored afterwards.
  """
  port = free_port()
  url = f'http://127.0.0.1:{port}'
  env = gcs_env(url, **extra_env)
  saved = {k: os.environ.get(k) for k in env}
  os.environ.update(env)
  proc = None
  try:
    proc = start_gcs_emulator(port)
    yield url
  finally:
    if proc is not None:
      proc.kill()
      proc.wait()
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def random_batch(config, vocab_size, length, seed=0):
  """A batch of the config's batch format (`[B, length]` arrays): random token ids in
  [1, vocab_size), positions 0..length-1, every other feature (weights, segment ids) ones."""
  import jax.numpy as jnp
  import numpy as np
  import models
  from data import pipeline
  shapes = pipeline.batch_shapes(models.batch_format(config.model.arch), config.train.batch_size,
                                 length)
  rng = np.random.default_rng(seed)
  fill = {'inputs': lambda shape: rng.integers(1, vocab_size, shape),
          'targets': lambda shape: rng.integers(1, vocab_size, shape),
          'positions': lambda shape: np.broadcast_to(np.arange(shape[1]), shape)}
  return {name: jnp.asarray(fill.get(name, np.ones)(shape), dtype)
          for name, (shape, dtype) in shapes.items()}
