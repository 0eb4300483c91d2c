"""The typed contract, tried as a contributor would: a sigmoid attention (Ramapuram et al. 2024) and
a learned per-distance bias, each defined here and registered with one dict entry. They train two
steps; decoding, the attention maps, the diagnostics, accounting and ring attention each either
work or are refused at validation in one line, from what the two classes declare."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import attention
from layers import attention_variants
from layers import contract
from layers import options
from layers import positions
from models import accounting
from tests.helpers import metric_rows, quick_config
from tests.unit.test_decoding import full_and_cached_logits
from training import loop
from training import validation
from training import validation_attention


# Sigmoid attention's b = -log(n), with n fixed at the training length: taken from the array's key
# length instead, a cached step (S = the cache's length) would weigh keys differently from the
# full forward pass (S = T), which the decoding test below caught.
SIGMOID_N = 16


class SigmoidAttention(attention.Attention):
  """Sigmoid attention: each weight is sigmoid(score + b) with b = -log(n) (Ramapuram et al.
  2024), instead of a softmax over the keys. Only the normalisation differs; the kernels fuse
  softmax, so it declares that it runs none."""

  uses_kernel = False
  has_scores = False  # the softmax statistics of the diagnostics do not describe it

  def normalise(self, logits, vis):
    weights = jax.nn.sigmoid(logits - np.log(SIGMOID_N))  # [B, N, T, S]
    return weights if vis is None else jnp.where(vis, weights, 0.0)


class DistanceBias(positions.Position):
  """A learned scalar per (distance |i - j| clipped at `max_distance`, head), added to the
  scores: a dense [T, S] bias, as T5's table but without buckets."""

  terms = ('bias',)

  def __init__(self, num_heads, max_distance, *, rngs):
    self.table = nnx.Param(0.1 * jax.random.normal(rngs.params(), (max_distance + 1, num_heads)))
    self.max_distance = max_distance

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    del max_length
    return cls(cfg.num_heads, 8, rngs=rngs)

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    del is_causal
    q_pos = jnp.arange(q.shape[1])[None] if q_pos is None else q_pos  # [B|1, T]
    k_pos = jnp.arange(k.shape[1])[None] if k_pos is None else k_pos  # [B|1, S]
    distance = jnp.minimum(jnp.abs(q_pos[:, :, None] - k_pos[:, None, :]), self.max_distance)
    bias = self.table[...][distance].transpose(0, 3, 1, 2)  # [B, N, T, S]
    return q, k, contract.ScoreTerms(bias=bias)


@pytest.fixture
def registered(monkeypatch):
  monkeypatch.setitem(attention_variants.VARIANTS, 'sigmoid', SigmoidAttention)
  monkeypatch.setitem(positions.POSITIONS, 'distance_bias', DistanceBias)


def _config(**model):
  config = validation.resolve(default.get_config('quick'))
  config.model.update(arch='decoder_only', attention='sigmoid', position='distance_bias',
                      num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64)
  config.model.update(model)
  return config


def _refusal(config):
  with pytest.raises(options.ConfigError) as e:
    validation.validate(config)
  assert '\n' not in str(e.value)
  return str(e.value)


def test_both_train_two_steps_with_diagnostics(registered, data_dir, tmp_path):
  del registered
  config = quick_config(data_dir, steps=2, log_every=1, eval_every=2, checkpoint_every=2,
                        warmup_steps=0, diagnostics=True)
  config.model.update(attention='sigmoid', position='distance_bias')
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path))
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2] and all(np.isfinite(r['loss']) for r in rows)
  # Diagnostics: activation RMS for every block, no softmax statistics (has_scores is False).
  assert any(k.startswith('act_rms/') for k in rows[0])
  assert not any(k.startswith('attn_entropy/') for k in rows[0])


def test_sigmoid_attention_equals_its_definition(registered):
  del registered
  layer = SigmoidAttention(16, 4, 2, rngs=nnx.Rngs(0))
  position = DistanceBias(4, 8, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (2, 6, 16))
  pos = jnp.arange(6)[None]
  got = layer(x, is_causal=True, positions=pos, position=position)
  q, k, v = (np.asarray(a, np.float64) for a in layer.project(x))
  k, v = np.repeat(k, 2, axis=2), np.repeat(v, 2, axis=2)  # query head n reads KV head n // 2
  bias = np.asarray(position.in_attention(x, x, pos, pos, is_causal=True)[2].bias, np.float64)
  s = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(4) + bias
  w = 1 / (1 + np.exp(-(s - np.log(SIGMOID_N)))) * np.tril(np.ones((6, 6)))
  want = np.einsum('bnts,bsnh->btnh', w, v)
  np.testing.assert_allclose(got, layer.out(jnp.asarray(want, jnp.float32)), atol=2e-6)
  # The attention maps are the variant's own weights, not a softmax.
  maps = layer.weights(x, is_causal=True, positions=pos, position=position)
  np.testing.assert_allclose(maps, w, atol=2e-6)


def test_cached_decoding_equals_the_full_forward(registered):
  """The dense cached step ends in the variant's `attend`, and the bias is recomputed against
  every cached slot: nothing was written for decoding."""
  del registered
  config = _config()
  validation.validate(config)
  model = models.build(config.model, 23, 16, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 10), 1, 23)
  full, cached = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens}, tokens)
  np.testing.assert_allclose(cached, full, atol=2e-5)


def test_accounting_counts_the_new_position_by_its_shapes(registered):
  del registered
  config = _config()
  validation.validate(config)
  counted = accounting.counted_params(accounting.abstract_model(config.model, 23, 16))
  formula = accounting.formula_params(config.model, 23, 16)
  assert counted == formula and formula['positions'] == 9 * 4  # (8 + 1) distances x 4 heads


def test_kernels_and_ring_are_refused_in_one_line(registered):
  del registered
  message = _refusal(_config(attention_impl='pallas'))
  assert message.startswith("model.attention_impl='pallas' is not used: model.attention="
                            "'sigmoid'")
  ring = _config(attention='dense', attention_impl='ring')
  ring.mesh.sequence = 2
  assert _refusal(ring) == (
      "model.position='distance_bias' adds a dense [T, S] bias, which model.attention_impl="
      "'ring' cannot take; valid values: blockwise, cudnn, pallas, xla (or model.position in: "
      'alibi, learned, nope, rope, sinusoidal, xpos)')
  validation.validate(_config(attention='dense', attention_impl='blockwise'))  # takes a bias


def test_a_variant_without_a_cached_step_is_refused_before_decoding(monkeypatch):
  class NoCache(SigmoidAttention):
    cached_decoding = None

  monkeypatch.setitem(attention_variants.VARIANTS, 'nocache', NoCache)
  model = _config(attention='nocache', position='rope').model
  with pytest.raises(options.ConfigError, match=r"^--translate=test decodes with a KV cache, "
                     r"which model.attention='nocache' \(NoCache\) does not have; valid values: "):
    validation_attention.check_decoding(model, '--translate=test')
