"""Hugging Face safetensors checkpoints into attnlab workdirs and back, one tensor at a time.

Import reads `config.json` and the safetensors shards (an index file included), checks every
tensor's name and shape against an abstract model (nothing allocated) before reading any, then
streams them: each tensor is read lazily, reshaped and placed on its sharding under the config's
mesh before the next is read, so the host never holds the model twice. The workdir is written
under `WORKDIR.partial` and renamed when complete: a kill mid-write leaves no workdir that
train.py would take for a run, and the rerun starts the partial one afresh.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open

from configs import text_lm
from layers import sharding
from layers.options import ConfigError
from models.hf import families
from models.hf.families import HFError
from training import checkpointing
from training import state as state_lib
from training import validation

INDEX_FILE = 'model.safetensors.index.json'
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'generation_config.json')
TOKENIZER_DIR = 'tokenizer'  # WORKDIR/tokenizer: the HF tokenizer files, copied as they are
SOURCE_FILE = 'hf_config.json'  # WORKDIR/hf_config.json: the imported config.json, for the record
MAX_CONTEXT = 2048  # the imported config's data.max_length at most (a fine-tune sets its own)


def read_json(path, what):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise HFError(f'{what} {path} is unreadable ({e})') from None


def is_workdir(path):
  """An attnlab workdir: a checkpoints/ folder, or a config.json with model and train sections."""
  if os.path.isdir(os.path.join(path, 'checkpoints')):
    return True
  cfg = os.path.join(path, 'config.json')
  if not os.path.isfile(cfg):
    return False
  try:
    with open(cfg) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(data.get('model'), dict) and isinstance(data.get('train'), dict)


def is_hf_folder(path):
  """A Hugging Face model folder: a config.json with a model_type."""
  cfg = os.path.join(path, 'config.json')
  try:
    with open(cfg) as f:
      return 'model_type' in json.load(f)
  except (OSError, ValueError):
    return False


def check_paths(hf_dir, workdir):
  """Refuses, in one line, an `hf_dir` that is not an HF folder and a `workdir` that is taken."""
  if not os.path.isdir(hf_dir):
    raise HFError(f'--hf_dir={hf_dir} is not a directory; valid: a Hugging Face model folder '
                  '(config.json and *.safetensors)')
  if is_workdir(hf_dir):
    raise HFError(f'--hf_dir={hf_dir} is an attnlab workdir; valid: a Hugging Face model folder '
                  '(to convert a workdir, use `python -m tools.hf export`)')
  if not os.path.isfile(os.path.join(hf_dir, 'config.json')):
    raise HFError(f'--hf_dir={hf_dir} has no config.json; valid: a Hugging Face model folder')
  if workdir.startswith('gs://'):
    raise HFError(f'--workdir={workdir}: import writes a local workdir; valid: a local path '
                  '(copy it to object storage afterwards)')
  if os.path.exists(workdir):
    if is_hf_folder(workdir):
      raise HFError(f'--workdir={workdir} is a Hugging Face folder; valid: a new directory')
    if not os.path.isdir(workdir) or os.listdir(workdir):
      raise HFError(f'--workdir={workdir} exists and is not empty; valid: a new directory')


def model_config(hf, mesh=None):
  """The attnlab config (text_lm, the model fields of `hf`, `mesh` in config.mesh), resolved and
  validated."""
  fields, length = families.to_model(hf)
  config = text_lm.get_config()
  config.mesh.update(mesh or {})
  for name, value in fields.items():
    if name not in config.model:
      raise HFError(f'this attnlab has no model.{name} (needed for {hf["model_type"]})')
    config.model[name] = value
  config.data.max_length = min(length, MAX_CONTEXT)
  try:
    validation.resolve(config)
    validation.validate_model(config)
    sharding.make_mesh(config.mesh)  # the device count fits the mesh
  except (ConfigError, ValueError) as e:
    raise HFError(f'the imported config is not valid: {e}') from None
  return config


def shard_files(hf_dir):
  """{tensor name: shard path} from the index file, or from every *.safetensors in `hf_dir`; a
  missing or unreadable (truncated) shard is one line."""
  index = os.path.join(hf_dir, INDEX_FILE)
  if os.path.isfile(index):
    weight_map = read_json(index, 'index file').get('weight_map', {})
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith('.safetensors'))
    weight_map = None
  if not files:
    raise HFError(f'--hf_dir={hf_dir} holds no *.safetensors shard (PyTorch .bin checkpoints are '
                  'not read: save with safe_serialization=True)')
  names = {}
  for name in files:
    path = os.path.join(hf_dir, name)
    if not os.path.isfile(path):
      raise HFError(f'shard {name} listed in {INDEX_FILE} is missing from {hf_dir}')
    try:
      with safe_open(path, 'flax') as f:
        names.update({k: (path, tuple(f.get_slice(k).get_shape())) for k in f.keys()})
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
      raise HFError(f'shard {path} is truncated or unreadable ({" ".join(str(e).split())})')
  if weight_map is not None:
    absent = sorted(set(weight_map) - set(names))
    if absent:
      raise HFError(f'{INDEX_FILE} lists {absent[0]} in {weight_map[absent[0]]}, which does not '
                    f'hold it ({len(absent)} tensors absent)')
  return names


BASE_PREFIXES = ('transformer.', 'model.')  # the base model's names inside the LM class's


def add_base_aliases(tensors, found):
  """Checkpoints saved from the base class (the Hub's GPT-2: `wte.weight`, `h.0...`) name their
  tensors without the LM class's prefix; transformers adds it when loading, and so does this."""
  for t in tensors:
    for prefix in BASE_PREFIXES:
      bare = t.name[len(prefix):]
      if t.name.startswith(prefix) and t.name not in found and bare in found:
        found[t.name] = found.pop(bare) + (bare,)
  return found


def check_tensors(tensors, found):
  """Every expected tensor present with its shape, and no tensor left over."""
  add_base_aliases(tensors, found)
  for t in tensors:
    if t.name not in found:
      raise HFError(f'tensor {t.name} is missing from the checkpoint (config.json implies it)')
    shape = found[t.name][1]
    if shape != t.shape:
      raise HFError(f'tensor {t.name} has shape {list(shape)}; its config implies {list(t.shape)}')
  expected = {t.name for t in tensors}
  extra = sorted(n for n in found if n not in expected
                 and not n.endswith(families.IGNORED_SUFFIXES))
  if extra:
    raise HFError(f'tensor {extra[0]} is not part of the model config.json describes '
                  f'({len(extra)} such tensors); attnlab would drop it')


def _norm_path(path):
  """('decoder', 'blocks', 0, ...) of a key path: dict keys and indices; the Variable's `.value`
  attribute (a GetAttrKey) left out."""
  return tuple(getattr(p, 'key', getattr(p, 'idx', None)) for p in path
               if not isinstance(p, jax.tree_util.GetAttrKey))


def param_paths(tree):
  """[(normalised path, leaf)] of a params state, in flatten order, and its treedef."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return [(_norm_path(p), leaf) for p, leaf in leaves], treedef


def check_against_model(tensors, abstract_params):
  """The tensor list covers every parameter of the (abstract) model once, shapes agreeing."""
  leaves, _ = param_paths(abstract_params)
  shapes = {path: tuple(leaf.shape) for path, leaf in leaves}
  covered = {}
  for t in tensors:
    for path, arr in zip(t.paths, t.to_ours(np.zeros(t.shape, np.float32))):
      if path not in shapes:
        raise HFError(f'tensor {t.name} maps to {path}, which the model does not have')
      if tuple(arr.shape) != shapes[path]:
        raise HFError(f'tensor {t.name} gives {path} shape {arr.shape}; the model has '
                      f'{shapes[path]}')
      covered[path] = t.name
  missing = [p for p in shapes if p not in covered]
  if missing:
    raise HFError(f'no checkpoint tensor gives the model parameter {missing[0]}')


def load_params(tensors, found, abstract_params):
  """The parameters, each converted from its tensor and placed on its sharding, one at a time."""
  leaves, treedef = param_paths(abstract_params)
  index = {path: i for i, (path, _) in enumerate(leaves)}
  out = [None] * len(leaves)
  for t in tensors:
    stored = found[t.name][2] if len(found[t.name]) > 2 else t.name  # its name in the file
    with safe_open(found[t.name][0], 'flax') as f:
      array = np.asarray(f.get_tensor(stored).astype(jnp.float32))
    for path, part in zip(t.paths, t.to_ours(array)):
      leaf = leaves[index[path]][1]
      out[index[path]] = jax.device_put(np.ascontiguousarray(part, leaf.dtype), leaf.sharding)
    del array
  return jax.tree_util.tree_unflatten(treedef, out)


def import_state(config, tensors, found):
  """The training state at step 0 with the checkpoint's parameters and a fresh optimiser."""
  mesh = sharding.make_mesh(config.mesh)
  _, tx, abstract = state_lib.abstract_state(config, config.model.vocab_size, mesh)
  check_against_model(tensors, abstract['params'])
  if jax.tree.leaves(abstract['buffers']):
    raise HFError('the imported model has buffers (random features) no checkpoint holds')
  params = load_params(tensors, found, abstract['params'])
  opt_shardings = jax.tree.map(lambda s: s.sharding, abstract['opt_state'])
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  counter = jax.tree.map(lambda s: jax.device_put(np.zeros((), np.int32), s.sharding),
                         {'step': abstract['step'], 'skipped': abstract['skipped']})
  return {**counter, 'params': params, 'buffers': abstract['buffers'], 'opt_state': opt_state}


def _tokenizer_files(hf_dir):
  return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]


def write_workdir(tmp, config, hf, state, hf_dir):
  """config.json, hf_config.json, tokenizer/ and the step-0 checkpoint, into `tmp`."""
  with open(os.path.join(tmp, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  with open(os.path.join(tmp, SOURCE_FILE), 'w') as f:
    json.dump(hf, f, indent=2)
  files = _tokenizer_files(hf_dir)
  if files:
    os.makedirs(os.path.join(tmp, TOKENIZER_DIR))
    for name in files:
      shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tmp, TOKENIZER_DIR, name))
  mngr = checkpointing.checkpoint_manager(tmp, config)
  # No data position: a run resuming this step starts its data from the beginning.
  mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                       data=ocp.args.JsonSave({})))
  mngr.wait_until_finished()
  mngr.close()


PARTIAL_MARK = '.tools-hf-partial'  # in a DIR.partial this tool made (and may remove)


def partial_dir(final):
  """A fresh `final.partial` to write into, marked as this tool's: one left by a killed run of
  the tool is removed; a folder of that name the tool did not make is refused in one line."""
  tmp = final.rstrip('/') + '.partial'
  if os.path.exists(tmp):
    ours = os.path.isdir(tmp) and (
        os.path.isfile(os.path.join(tmp, PARTIAL_MARK))
        or not os.listdir(tmp))  # empty: killed between creating and marking it
    if not ours:
      raise HFError(f'{tmp} exists and was not left by tools.hf; move it away (the conversion '
                    'writes there before renaming)')
    shutil.rmtree(tmp)  # a conversion killed mid-write: start it afresh
  os.makedirs(tmp)
  open(os.path.join(tmp, PARTIAL_MARK), 'w').close()
  return tmp


def finish_partial(tmp, final):
  """Renames a complete `tmp` (partial_dir) to `final` (absent or an empty directory)."""
  os.remove(os.path.join(tmp, PARTIAL_MARK))
  if os.path.isdir(final):
    os.rmdir(final)
  os.rename(tmp, final)


def parse_mesh(text):
  """'fsdp=4,tensor=2' -> {'fsdp': 4, 'tensor': 2}, each a config.mesh axis; one line if not."""
  out = {}
  for item in filter(None, (text or '').split(',')):
    axis, _, size = item.partition('=')
    if axis.strip() not in sharding.MESH_AXES or not size.strip().isdigit() or int(size) < 1:
      raise HFError(f'--mesh={text!r}: valid: comma-separated AXIS=SIZE with AXIS one of '
                    f'{list(sharding.MESH_AXES)} and SIZE a positive integer, e.g. fsdp=4,tensor=2')
    out[axis.strip()] = int(size)
  return out


def import_checkpoint(hf_dir, workdir, *, mesh=None, log=print):
  """`python -m tools.hf import`: HF folder `hf_dir` -> a new attnlab `workdir`.

  `mesh` ({axis: size}, config.mesh) is the mesh the parameters are placed on as they are read
  (and the imported config's); default one device. Every check (paths, config fields, the mesh,
  shard files, tensor names and shapes, the abstract model) runs before anything is written.
  Returns the workdir's config.
  """
  check_paths(hf_dir, workdir)
  hf = read_json(os.path.join(hf_dir, 'config.json'), 'config.json')
  has_tokenizer = os.path.isfile(os.path.join(hf_dir, 'tokenizer.json'))
  config = model_config(hf, mesh)
  if has_tokenizer and 'tokenizer' in config.data:
    config.data.tokenizer = os.path.join(os.path.abspath(workdir), TOKENIZER_DIR)
  tensors = families.tensor_list(families.resolved_model(config))
  found = shard_files(hf_dir)
  check_tensors(tensors, found)
  state = import_state(config, tensors, found)
  tmp = partial_dir(workdir)
  write_workdir(tmp, config, hf, state, hf_dir)
  finish_partial(tmp, workdir)
  if not has_tokenizer:
    log(f'hf: warning: {hf_dir} has no tokenizer.json; imported the model alone (set '
        'data.tokenizer to a folder holding one to train on text)')
  log(f'hf: imported {hf["model_type"]} ({len(tensors)} tensors, '
      f'{sum(int(np.prod(t.shape)) for t in tensors):,} parameters) into {workdir}')
  return config
