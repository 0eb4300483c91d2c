"""Training diagnostics (train.py): per-layer gradient norms and update ratios, attention max logit
and entropy, activation RMS, and the files a run writes (init_grad_norms.json, run_info.json)."""

from tests.helpers import tiny_config, quick_jit
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from layers import options
from training import validation
from training import diagnostics
from training import state as state_lib
from training import steps as steps_lib

VOCAB, B, T = 50, 4, 16


def batch(seed=0, segments=False):
  rng = np.random.default_rng(seed)
  out = {'inputs': rng.integers(0, VOCAB, (B, T)), 'targets': rng.integers(0, VOCAB, (B, T)),
         'weights': np.ones((B, T), np.float32)}
  if segments:  # two packed pairs per row, and padding at the end of row 0
    seg = np.where(np.arange(T) < T // 2, 1, 2)[None].repeat(B, 0)
    seg[0, -3:] = 0
    out['segment_ids'] = seg.astype(np.int32)
    out['positions'] = np.where(np.arange(T) < T // 2, np.arange(T), np.arange(T) - T // 2)[
        None].repeat(B, 0)
    out['weights'] = (seg > 0).astype(np.float32)
  return out


def test_parameter_groups_are_the_blocks_plus_the_rest():
  graphdef, _, state = state_lib.create_state(tiny_config(), VOCAB)
  groups, leaf_groups, sizes = diagnostics.param_groups(state['params'])
  assert groups == ['decoder/blocks/0', 'decoder/blocks/1', 'decoder/blocks/2', 'decoder/embed',
                    'decoder/final_norm']
  assert len(leaf_groups) == len(jax.tree.leaves(state['params']))
  assert sum(sizes.values()) == sum(x.size for x in jax.tree.leaves(state['params']))
  # 4·D² attention + 2·D·F feed-forward + two LayerNorms (scale and bias) per block.
  assert sizes['decoder/blocks/0'] == 4 * 32 ** 2 + 2 * 32 * 64 + 4 * 32
  assert sizes['decoder/embed'] == VOCAB * 32
  assert diagnostics.param_group(('encoder', 'blocks', 11, 'ffn', 'wi', 'kernel')) == (
      'encoder/blocks/11')
  # Ordered by block number, not as text (10 after 9).
  assert diagnostics._group_sort_key('decoder/blocks/10') > (
      diagnostics._group_sort_key('decoder/blocks/9'))


def test_group_norms_add_up_to_the_global_norms():
  config = tiny_config(norm_position='post')
  config.train.warmup_steps = 0  # the first update is not zero
  graphdef, tx, state = state_lib.create_state(config, VOCAB)
  groups, leaf_groups, _ = diagnostics.param_groups(state['params'])
  before = jax.tree.map(np.asarray, state['params'])
  state, sums = quick_jit(functools.partial(steps_lib.train_step, graphdef, tx, jax.random.key(0),
                                          leaf_groups=leaf_groups))(state, batch())
  diag = jax.device_get(sums['diag'])
  assert diag['grad_sq'].shape == (len(groups),)
  np.testing.assert_allclose(np.sqrt(diag['grad_sq'].sum()), sums['grad_norm'], rtol=1e-5)
  np.testing.assert_allclose(np.sqrt(diag['param_sq'].sum()), optax.global_norm(before),
                             rtol=1e-5)
  # The update group norms are those of the parameter change of each block.
  after = jax.tree.map(np.asarray, state['params'])
  delta = jax.tree.map(lambda a, b: (a - b).astype(np.float64), after, before)
  manual = np.zeros(len(groups))
  for leaf, g in zip(jax.tree.leaves(delta), leaf_groups):
    manual[g] += np.sum(leaf ** 2)
  np.testing.assert_allclose(diag['update_sq'], manual, rtol=1e-3)
  metrics = diagnostics.diagnostic_metrics(groups, sums['diag'])
  assert set(metrics) == {'update_ratio'} | {f'{k}/{g}' for g in groups
                                              for k in ('grad_norm', 'update_ratio')}
  assert 0 < metrics['update_ratio'] < 0.1
  np.testing.assert_allclose(metrics['update_ratio/decoder/blocks/1'],
                             math.sqrt(manual[1] / diag['param_sq'][1]), rtol=1e-3)
  assert 'decoder/final_norm' not in groups  # Post-LN has no final norm


@pytest.mark.parametrize('segments', [False, True])
def test_attention_entropy_matches_the_attention_maps(segments):
  config = tiny_config(position='alibi')
  graphdef, _, state = state_lib.create_state(config, VOCAB)
  x = batch(1, segments)
  diag = quick_jit(functools.partial(diagnostics.diagnostic_pass, graphdef))(state['params'], x)
  keys = {f'{k}/decoder/blocks/{i}' for i in range(3)
          for k in ('act_rms', 'attn_max_logit', 'attn_entropy', 'attn_sink_share')}
  assert set(diag) == keys
  model = nnx.merge(graphdef, state['params'])
  maps = model.decoder.attention_weights(jnp.asarray(x['inputs']),
                                         segment_ids=x.get('segment_ids'),
                                         positions=x.get('positions'), is_causal=True)
  real = np.ones((B, T)) if not segments else (x['segment_ids'] > 0).astype(float)
  for i, m in enumerate(maps):
    p = np.asarray(m['self'], np.float64)  # [B, N, T, S]
    ent = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1)  # [B, N, T]
    w = np.broadcast_to(real[:, None, :], ent.shape)
    np.testing.assert_allclose(diag[f'attn_entropy/decoder/blocks/{i}'],
                               np.sum(ent * w) / np.sum(w), rtol=1e-4)
    assert 0 < float(diag[f'attn_entropy/decoder/blocks/{i}']) < math.log(T)


def test_golden_values_zero_queries_and_post_ln_rms():
  """Zero query kernels: every logit is 0, so the max logit is 0, each causal row's entropy is
  log(i + 1) and its share on the first token 1 / (i + 1); Post-LN's block outputs are LayerNorm
  outputs (unit scale at init): RMS 1."""
  config = tiny_config(norm_position='post', position='sinusoidal')
  graphdef, _, state = state_lib.create_state(config, VOCAB)
  params = jax.tree_util.tree_map_with_path(
      lambda path, v: jnp.zeros_like(v) if 'query' in jax.tree_util.keystr(path) else v,
      state['params'])
  diag = quick_jit(functools.partial(diagnostics.diagnostic_pass, graphdef))(params, batch())
  expected = np.mean(np.log(np.arange(1, T + 1)))
  for i in range(3):
    assert float(diag[f'attn_max_logit/decoder/blocks/{i}']) == 0.0
    np.testing.assert_allclose(diag[f'attn_entropy/decoder/blocks/{i}'], expected, rtol=1e-5)
    np.testing.assert_allclose(diag[f'attn_sink_share/decoder/blocks/{i}'],
                               np.mean(1.0 / np.arange(1, T + 1)), rtol=1e-5)
    np.testing.assert_allclose(diag[f'act_rms/decoder/blocks/{i}'], 1.0, atol=1e-3)


def test_diagnostics_config_is_validated():
  config = tiny_config()
  config.train.diagnostics = False
  validation.validate(config)
  config.train.diagnostics_batch = -1
  with pytest.raises(options.ConfigError, match='diagnostics_batch'):
    validation.validate(config)
