"""An attnlab workdir's newest parameters as a Hugging Face folder, and its logits for one row."""

import json
import os
import shutil

import jax
import ml_collections
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from data import pipeline
from layers import sharding
from tools.hf import convert
from models.hf import families
from models.hf.families import HFError
from training import checkpointing
from training import state as state_lib

SHARD_BYTES = 2 << 30  # export shards of at most 2 GiB each (an index file when there are several)


def workdir_config(workdir):
  """The config of an attnlab workdir, refused in one line if `workdir` is not one (a Hugging Face
  folder, a missing directory) or holds another architecture."""
  if not convert.is_workdir(workdir):
    what = 'a Hugging Face folder' if convert.is_hf_folder(workdir) else 'not an attnlab workdir'
    raise HFError(f'--workdir={workdir} is {what}; valid: the workdir of train.py or tools.hf '
                  'import (config.json with model and train sections)')
  config = ml_collections.ConfigDict(
      convert.read_json(os.path.join(workdir, 'config.json'), 'config.json'))
  families.check_convertible(config.model)
  return config


def load(workdir):
  """(config, model, step) of `workdir`'s newest checkpoint; the model is built on the config's
  mesh and restored into its shardings."""
  config = workdir_config(workdir)
  vocab = vocab_size(config)
  mesh = sharding.make_mesh(config.mesh)
  graphdef, _, abstract = state_lib.abstract_state(config, vocab, mesh)
  mngr = checkpointing.checkpoint_manager(workdir, config)
  if mngr.latest_step() is None:
    raise HFError(f'--workdir={workdir} holds no checkpoint')
  restored = checkpointing.restore_newest_good(mngr, abstract, workdir, move_aside=False)
  mngr.close()
  state, _, step, _ = restored
  model = nnx.merge(graphdef, *state_lib.model_variables(state))
  return config, model, step


def vocab_size(config):
  """V: model.vocab_size, or the size of the run's tokenizer."""
  return config.model.get('vocab_size', 0) or pipeline.get_tokenizer(config.data).vocab_size


def logits(workdir, ids):
  """`[T, V]` float32 logits of the newest parameters of `workdir` for one row of token ids."""
  config, model, _ = load(workdir)
  vocab = vocab_size(config)
  bad = [i for i in ids if not 0 <= i < vocab]
  if bad:
    raise HFError(f'--ids holds {bad[0]}, outside the vocabulary; valid: 0 to {vocab - 1}')
  ids = np.asarray(ids, np.int32)[None]  # [1, T]
  return np.asarray(model({'inputs': ids}), np.float32)[0]


def _source(workdir):
  path = os.path.join(workdir, convert.SOURCE_FILE)
  return convert.read_json(path, convert.SOURCE_FILE) if os.path.isfile(path) else {}


DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16}


def hf_tensors(model, tensors, dtype='float32'):
  """Yields (name, numpy array of `dtype`) in the checkpoint's layout, one tensor at a time."""
  leaves, _ = convert.param_paths(nnx.state(model, nnx.Param))
  by_path = dict(leaves)
  for t in tensors:
    parts = [np.asarray(jax.device_get(by_path[p]), np.float32) for p in t.paths]
    yield t.name, np.ascontiguousarray(t.to_hf(parts)).astype(DTYPES[dtype])


def write_shards(out, named_arrays, shard_bytes=SHARD_BYTES):
  """model.safetensors, or model-0000i-of-0000n.safetensors and an index when the tensors pass
  `shard_bytes`. Each shard is written as soon as it is full (under a temporary name, renamed
  once the count is known), so at most one shard is in memory; a single tensor larger than
  `shard_bytes` is a shard of its own."""
  written, current, size = [], {}, 0

  def flush():
    path = os.path.join(out, f'shard-{len(written)}.tmp')
    save_file(current, path, metadata={'format': 'pt'})
    written.append((path, list(current)))

  for name, array in named_arrays:
    if current and size + array.nbytes > shard_bytes:
      flush()
      current, size = {}, 0
    current[name] = array
    size += array.nbytes
  if current or not written:
    flush()
  if len(written) == 1:
    os.rename(written[0][0], os.path.join(out, 'model.safetensors'))
    return
  weight_map = {}
  for i, (path, names) in enumerate(written):
    name = f'model-{i + 1:05d}-of-{len(written):05d}.safetensors'
    os.rename(path, os.path.join(out, name))
    weight_map.update({k: name for k in names})
  with open(os.path.join(out, convert.INDEX_FILE), 'w') as f:
    json.dump({'metadata': {}, 'weight_map': weight_map}, f, indent=2)


def tokenizer_dir(workdir, config):
  """The folder of the run's Hugging Face tokenizer files, or None: the run's own copy (an import
  writes WORKDIR/tokenizer), else the folder its data.tokenizer names (a fine-tune of an import
  reads the source's copy, configs/pretrained.py)."""
  own = os.path.join(workdir, convert.TOKENIZER_DIR)
  if os.path.isdir(own):
    return own
  named = config.data.get('tokenizer')
  if isinstance(named, str) and os.path.isfile(os.path.join(named, 'tokenizer.json')):
    return named
  return None


def export_checkpoint(workdir, out, *, model_type=None, dtype='float32', shard_bytes=SHARD_BYTES,
                      log=print):
  """`python -m tools.hf export`: the newest parameters of `workdir` as a Hugging Face folder,
  stored as `dtype` (float32: bit for bit; bfloat16: rounded to nearest even, half the bytes)."""
  if dtype not in DTYPES:
    raise HFError(f'--dtype={dtype!r} unknown; valid: {list(DTYPES)}')
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise HFError(f'--out={out} exists and is not empty; valid: a new directory')
  config = workdir_config(workdir)
  m = families.resolved_model(config)
  kind = model_type or families.family_of(m)
  source = _source(workdir)
  vocab = vocab_size(config)
  ids = {k: source.get(f'{k}_token_id') for k in ('bos', 'eos', 'pad')}
  m.vocab_size = vocab
  hf = families.to_hf(m, kind, families.context_length(config, m), vocab, ids)  # checks first
  hf['torch_dtype'] = dtype
  config, model, step = load(workdir)
  tmp = convert.partial_dir(out)
  write_shards(tmp, hf_tensors(model, families.tensor_list(m), dtype), shard_bytes)
  with open(os.path.join(tmp, 'config.json'), 'w') as f:
    json.dump(hf, f, indent=2)
  tokenizer = tokenizer_dir(workdir, config)
  for name in os.listdir(tokenizer) if tokenizer else ():
    shutil.copyfile(os.path.join(tokenizer, name), os.path.join(tmp, name))
  convert.finish_partial(tmp, out)
  log(f'hf: exported step {step} of {workdir} as {kind} into {out}')
  if tokenizer is None:
    log(f'hf: warning: {workdir} trained with data.tokenizer={config.data.get("tokenizer")!r}, '
        'no Hugging Face tokenizer folder; exported the model alone (load a tokenizer of '
        f'{vocab} ids beside it)')
  return hf
