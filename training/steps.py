"""The train and eval steps: pure functions of the state and a batch
(jit them, donate the state)."""

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np
import optax

from layers import moe
from training import diagnostics
from training import losses
from training import state as state_lib


def compute_metrics(logits, targets, weights):
  """Weighted sums (reduced across batches, then divided): loss, correct tokens, token count."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
  correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)  # [B, T]
  return {'loss_sum': jnp.sum(ce * weights), 'correct_sum': jnp.sum(correct * weights),
          'weight_sum': jnp.sum(weights)}


def z_loss_sum(logits, weights):
  """sum of w · (log Z)² over the tokens, Z = sum_v exp(logits): PaLM's z-loss (Chowdhery et al.
  2022), unscaled by its coefficient; it pulls log Z towards 0, keeping the softmax normaliser
  from drifting."""
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  return jnp.sum(jnp.square(log_z) * weights)


# PaLM's z-loss in a step's sums (train.z_loss > 0): sum of w · (log Z)² (`z_loss_sum`), summed
# like the loss over the log window; the log row shows its mean per token of weight, 'z_loss'.
Z_LOSS_SUM = 'z_loss_sum'


# The MoE layers' balancing terms in a step's sums (each the mean over the MoE layers, unscaled by
# its coefficient): the loop sums them over the log window and the log row shows their means.
MOE_METRICS = tuple(f'moe_{name}' for name in moe.STATS)


def with_moe_stats(fn, model):
  """(fn(model), {'moe_aux_loss', 'moe_z_loss', 'moe_drop_fraction', 'moe_load_cv'}): the
  statistics every MoE layer sows during `fn` (layers.moe.MoE), each averaged over the layers'
  calls; {} for a model without MoE layers. Layers with auxiliary-loss-free balancing add
  'moe_load': {module path: the assignments `[E]` each expert was routed}, for `update_biases`."""
  out, sown = nnx.capture(fn, nnx.Intermediate)(model)
  calls = [(path[:-1], call) for path, var in nnx.to_flat_state(sown) if path[-1] == 'moe'
           for call in var.get_value()]
  if not calls:
    return out, {}
  stats = {f'moe_{k}': jnp.mean(jnp.stack([c[k] for _, c in calls])) for k in moe.STATS}
  loads = {}
  for path, call in calls:
    if 'load' in call:
      key = '/'.join(map(str, path))
      loads[key] = loads.get(key, 0.0) + call['load']
  if loads:
    stats['moe_load'] = loads
  return out, stats


def update_biases(graphdef, params, buffers, loads):
  """The buffers after one step of every MoE layer's auxiliary-loss-free bias update
  (`layers.moe.MoE.update_bias`) by its step's `loads` ({module path: `[E]`}, `with_moe_stats`)."""
  model = nnx.merge(graphdef, params, buffers, copy=True)  # `buffers` itself stays as it was
  for path, module in nnx.iter_modules(model):
    key = '/'.join(map(str, path))
    if key in loads:
      module.update_bias(loads[key])
  return nnx.split(model, nnx.Param, ...)[2]


def finalize(sums):
  """Turns summed metrics into means."""
  denom = max(float(sums['weight_sum']), 1.0)
  out = {'loss': float(sums['loss_sum']) / denom, 'accuracy': float(sums['correct_sum']) / denom}
  out.update({k: float(v) for k, v in sums.items() if not k.endswith('_sum')})
  return out


def count_tokens(batch):
  """Real (non-padding) tokens of a batch, source and target sides together."""
  groups = [k for k in ('segment_ids', 'src_segment_ids', 'tgt_segment_ids') if k in batch]
  if not groups:
    return int(np.sum(batch['weights'] > 0))
  return int(sum(np.sum(batch[k] > 0) for k in groups))


def step_sums(model, batch, rngs, loss_chunk=0, moe_loss=(0.0, 0.0), z_loss=0.0):
  """The summed metrics of one (micro-)batch, the MoE layers' terms (`MOE_METRICS`, if any), and
  'objective_sum': the summed loss to differentiate, the task loss plus the weight sum times the
  `moe_loss` (aux, z) coefficients' balancing terms (each per token as much as the loss's mean),
  plus, with `z_loss` > 0, `z_loss` times the z-loss sum (`Z_LOSS_SUM`, reported apart)."""

  def forward(model):
    if loss_chunk:  # the vocabulary a tile at a time: [B, T, V] never exists (training.losses)
      hidden, targets, weights = model.loss_features(batch, rngs=rngs)
      return losses.chunked_metrics(hidden, model.output_embedding(), targets, weights, loss_chunk,
                                    softcap=model.output_softcap(), z_loss=z_loss)
    logits, targets, weights = model.loss_terms(batch, rngs=rngs)  # [B, T, V], [B, T], [B, T]
    sums = compute_metrics(logits, targets, weights)
    if z_loss:
      sums[Z_LOSS_SUM] = z_loss_sum(logits, weights)
      sums['objective_sum'] = sums['loss_sum'] + z_loss * sums[Z_LOSS_SUM]
    return sums

  sums, stats = with_moe_stats(forward, model)
  sums.setdefault('objective_sum', sums['loss_sum'])  # without the z-loss: the task loss alone
  if stats:
    sums.update(stats)
    sums['objective_sum'] += sums['weight_sum'] * (moe_loss[0] * stats['moe_aux_loss'] +
                                                   moe_loss[1] * stats['moe_z_loss'])
  return sums


def train_step(graphdef, tx, base_rng, state, batch, leaf_groups=None, skip_nonfinite=False,
               accum_steps=1, compute_dtype='float32', loss_chunk=0, moe_loss=(0.0, 0.0),
               z_loss=0.0):
  """One optimisation step, a pure function of the state (jit it with the state donated).

  With `accum_steps` = k > 1 the batch is k micro-batches whose gradients of the summed loss are
  accumulated in a scan and divided by the whole batch's weight: the full-batch gradient, with the
  activations of one micro-batch in memory. `compute_dtype` ('bfloat16'): the forward and
  backward passes run on parameters cast to it, while the parameters, their gradients and the
  optimiser stay float32 (and logits, loss and softmax statistics are float32 in the models).

  With `loss_chunk` = C > 0 the output projection and loss run in tiles of B·T·C/V tokens
  (training.losses.chunked_metrics): the `[B, T, V]` logits are never materialised.

  With `skip_nonfinite`, a step whose loss or gradient norm is not finite leaves the parameters,
  optimiser state and buffers (the MoE selection biases) unchanged (the data and the step counter
  still advance) and counts in `state['skipped']`.

  With MoE layers (layers.moe) the differentiated objective adds, per token of weight,
  `moe_loss` = (aux, z) coefficients times the layers' mean load-balancing and z-losses; the sums
  report the task loss (`loss_sum`) and the unscaled terms (`MOE_METRICS`) apart. With `z_loss`
  > 0 it adds PaLM's z-loss, `z_loss` · (log Z)² per token of weight (`Z_LOSS_SUM` apart).

  With `leaf_groups` (from `param_groups`), `sums['diag']` holds `[G]` squared norms per group of
  the gradient, the update and the parameters before the update (a few reductions: cheap).
  """
  # Fold the step into the key: a resumed run draws the same dropout/masks as an uninterrupted one.
  dropout_rng, mask_rng = jax.random.split(jax.random.fold_in(base_rng, state['step']))

  def sums_fn(params, batch, dropout_rng, mask_rng):
    model = nnx.merge(graphdef, state_lib.cast_params(params, compute_dtype), state['buffers'])
    return step_sums(model, batch, nnx.Rngs(dropout=dropout_rng, mask=mask_rng), loss_chunk,
                     moe_loss, z_loss)

  if accum_steps == 1:
    def loss_fn(params):
      sums = sums_fn(params, batch, dropout_rng, mask_rng)
      return sums['objective_sum'] / jnp.maximum(sums['weight_sum'], 1.0), sums

    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state['params'])
  else:
    # Micro-batch i takes rows i, i + k, i + 2k, ...: each data shard keeps its own rows.
    micro = jax.tree.map(
        lambda x: x.reshape(-1, accum_steps, *x.shape[1:]).swapaxes(0, 1), batch)
    grad_sum = jax.grad(lambda p, *a: (lambda s: (s['objective_sum'], s))(sums_fn(p, *a)),
                        has_aux=True)

    def accumulate(carry, inputs):
      micro_batch, i = inputs
      g, s = grad_sum(state['params'], micro_batch, jax.random.fold_in(dropout_rng, i),
                      jax.random.fold_in(mask_rng, i))
      return jax.tree.map(jnp.add, carry, (g, s)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        grad_sum, state['params'], jax.tree.map(lambda x: x[0], micro), dropout_rng, mask_rng))
    (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(accum_steps)))
    grads = jax.tree.map(lambda g: g / jnp.maximum(sums['weight_sum'], 1.0), grads)
    # Per micro-batch means, summed over the k micro-batches: their mean.
    sums.update({k: sums[k] / accum_steps for k in MOE_METRICS if k in sums})
  del sums['objective_sum']
  loads = sums.pop('moe_load', None)
  updates, opt_state = tx.update(grads, state['opt_state'], state['params'])
  params = optax.apply_updates(state['params'], updates)
  sums['grad_norm'] = optax.global_norm(grads)
  sums['param_norm'] = optax.global_norm(params)
  if leaf_groups is not None:
    g = diagnostics.num_groups(leaf_groups)
    sums['diag'] = {'grad_sq': diagnostics.group_sq_norms(grads, leaf_groups, g),
                    'update_sq': diagnostics.group_sq_norms(updates, leaf_groups, g),
                    'param_sq': diagnostics.group_sq_norms(state['params'], leaf_groups, g)}
  buffers = (state['buffers'] if not loads else
             update_biases(graphdef, state['params'], state['buffers'], loads))
  new = {'step': state['step'] + 1, 'params': params, 'buffers': buffers,
         'opt_state': opt_state, 'skipped': state['skipped']}
  if skip_nonfinite:
    _skip_if_nonfinite(state, new, sums)
  return new, sums


def _skip_if_nonfinite(state, new, sums):
  """`new` (in place) keeps `state`'s parameters, optimiser state and buffers, and `sums` reports
  zeros, where the step's loss or gradient norm is not finite; `new['skipped']` counts it."""
  ok = jnp.isfinite(sums['loss_sum']) & jnp.isfinite(sums['grad_norm'])
  keep = ('params', 'opt_state') + (('buffers',) if new['buffers'] is not state['buffers'] else ())
  new.update(zip(keep, jax.tree.map(lambda a, b: jnp.where(ok, a, b),
                                    tuple(new[k] for k in keep), tuple(state[k] for k in keep))))
  new['skipped'] = state['skipped'] + (~ok).astype(jnp.int32)
  # Report the skipped step's values as zeros so that window sums stay finite.
  for k in ('loss_sum', 'correct_sum', 'weight_sum', 'grad_norm', 'param_norm',
            *(k for k in (Z_LOSS_SUM, *MOE_METRICS) if k in sums)):
    sums[k] = jnp.where(ok, sums[k], 0.0)


def eval_step(graphdef, variables, batch):
  """Summed metrics of one batch without dropout; `variables` as in `diagnostic_pass`."""
  model = state_lib.merge(graphdef, variables)
  return compute_metrics(*model.loss_terms(batch))


