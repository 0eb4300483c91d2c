"""Training diagnostics: per-block gradient/update norms in the step, and activation and attention
statistics of one batch read from the model's own forward pass."""

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np

from layers import block as block_lib
from training import state as state_lib


def param_group(path):
  """The diagnostics group of a parameter path: one per Transformer block, else its owner module.

  ('decoder', 'blocks', 3, 'ffn', 'wi', 'kernel') -> 'decoder/blocks/3';
  ('decoder', 'embed', 'embedding') -> 'decoder/embed'; ('decoder', 'final_norm', 'scale') ->
  'decoder/final_norm'. Every parameter is in exactly one group, so the groups' squared norms sum
  to the global squared norm.
  """
  keys = [str(k) for k in path]
  if 'blocks' in keys[:-1]:
    i = keys.index('blocks')
    return '/'.join(keys[:i + 2])
  return '/'.join(keys[:-1][:2]) or keys[0]


def _path_keys(path):
  """A jax key path of an nnx.State leaf -> its plain keys, without the trailing `.value`."""
  keys = [getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))) for k in path]
  return tuple(keys[:-1] if keys and keys[-1] == 'value' else keys)


def _group_sort_key(name):
  return tuple((0, int(p), '') if p.isdigit() else (1, 0, p) for p in name.split('/'))


def _layer_groups(keys, leaf):
  """The per-layer groups of a scanned stack's leaf ('blocks' followed by a name, not a layer
  number; row i of its leading `[L]` axis is layer i), or None for any other leaf."""
  if 'blocks' not in keys[:-1]:
    return None
  i = keys.index('blocks')
  if str(keys[i + 1]).isdigit():
    return None
  return tuple(param_group(keys[:i + 1] + (r,) + keys[i + 1:]) for r in range(leaf.shape[0]))


def param_groups(params):
  """(group names in order, the group index of every leaf of `params`, parameters per group).

  A scanned stack's leaf `[L, ...]` (model.scan_layers) spans L groups: its index is a tuple, one
  group per layer, so the groups are the same blocks as the unrolled model's.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  leaf_names = []
  for path, leaf in leaves:
    keys = _path_keys(path)
    leaf_names.append(_layer_groups(keys, leaf) or param_group(keys))
  flat = [n for name in leaf_names for n in (name if isinstance(name, tuple) else (name,))]
  names = sorted(set(flat), key=_group_sort_key)
  index = {n: i for i, n in enumerate(names)}
  sizes = {n: 0 for n in names}
  for name, (_, leaf) in zip(leaf_names, leaves):
    for n in (name if isinstance(name, tuple) else (name,)):
      sizes[n] += int(np.prod(leaf.shape)) // (len(name) if isinstance(name, tuple) else 1)
  return names, tuple(tuple(index[n] for n in name) if isinstance(name, tuple) else index[name]
                      for name in leaf_names), sizes


def num_groups(leaf_groups):
  """The number of groups of `param_groups`'s leaf indices."""
  return 1 + max(max(g) if isinstance(g, tuple) else g for g in leaf_groups)


def group_sq_norms(tree, leaf_groups, num_groups):
  """`[num_groups]` float32: the sum of squares of the leaves of each group."""
  sq = [jnp.zeros((), jnp.float32)] * num_groups
  for leaf, g in zip(jax.tree.leaves(tree), leaf_groups):
    if isinstance(g, tuple):  # a scanned stack's [L, ...] leaf: row i goes to layer i's group
      rows = jnp.sum(jnp.square(leaf.astype(jnp.float32)).reshape(len(g), -1), 1)  # [L]
      for i, gi in enumerate(g):
        sq[gi] = sq[gi] + rows[i]
    else:
      sq[g] = sq[g] + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
  return jnp.stack(sq)


def diagnostic_pass(graphdef, variables, batch):
  """Per-block activation RMS and attention max logit, entropy and sink share on `batch` (no
  dropout; jit it), and under model.norm_position='rezero' each block's residual gates
  (`gate_self`, `gate_cross`, `gate_ffn`): the value each sublayer's output is multiplied by, 0 at
  initialisation.

  The statistics come from the model's own forward pass: every `Block` is switched to
  `collect_stats`, sows them (its self-attention's `score_stats` where it `has_scores`), and they
  are read back with `nnx.capture`. The train step itself never collects them.

  `variables`: `model_variables(state)` (or the params alone for a model without buffers).

  Returns:
    {'act_rms/decoder/blocks/0': scalar, 'attn_max_logit/...', 'attn_entropy/...',
     'attn_sink_share/...',
     'gate_self/...' (rezero), ...}.
  """
  model = state_lib.merge(graphdef, variables)
  # Scanned stacks (model.scan_layers) run here layer by layer, each block its own module named
  # .../blocks/<i> as in an unrolled model (this pass is not differentiated: no remat to keep).
  for stack in [m for _, m in nnx.iter_modules(model) if getattr(m, 'scan_layers', False)]:
    stack.unroll()
  for _, m in nnx.iter_modules(model):
    if isinstance(m, block_lib.Block):
      m.collect_stats = True
  _, sown = nnx.capture(lambda m: m.loss_terms(batch), nnx.Intermediate)(model)
  out = {}
  for path, var in nnx.to_flat_state(sown):
    if path[-1] != 'stats':
      continue
    # One entry per call of the block; a block called more than once reports its last call.
    for key, value in var.get_value()[-1].items():
      out[f'{key}/{"/".join(map(str, path[:-1]))}'] = value
  return out


def diagnostic_metrics(groups, diag):
  """Host-side: per-group gradient norm and update/parameter norm ratio, and the global ratio."""
  diag = jax.device_get(diag)
  grad, upd, par = (np.sqrt(np.asarray(diag[k], np.float64))
                    for k in ('grad_sq', 'update_sq', 'param_sq'))
  out = {'update_ratio': float(np.sqrt(np.sum(np.square(upd))) /
                               max(np.sqrt(np.sum(np.square(par))), 1e-30))}
  for i, name in enumerate(groups):
    out[f'grad_norm/{name}'] = float(grad[i])
    out[f'update_ratio/{name}'] = float(upd[i] / par[i]) if par[i] > 0 else 0.0
  return out


def unigram_entropy(batch):
  """Entropy (nats) of the weighted target tokens of one batch: the loss of a unigram model."""
  prefix = 'tgt_' if 'tgt_targets' in batch else ''  # encoder-decoder batches
  targets = np.asarray(batch[f'{prefix}targets']).ravel()
  weights = np.asarray(batch[f'{prefix}weights'], np.float64).ravel()
  counts = np.bincount(targets, weights=weights)
  p = counts[counts > 0] / counts.sum()
  return float(-np.sum(p * np.log(p)))


