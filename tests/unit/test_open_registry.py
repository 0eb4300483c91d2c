"""The open registry: a variant defined here, registered with one dict entry, validated by its own
check and trained two steps through the training library, with no other file touched
(ARCHITECTURE.md, "Adding a variant", walks through this example)."""

from flax import nnx
import jax.numpy as jnp
import pytest

from layers import attention
from layers import attention_variants
from layers import options
from tests.helpers import metric_rows, quick_config
from training import evaluation
from training import loop
from training import validation


class CosineAttention(attention.Attention):
  """Cosine attention (Swin Transformer V2): q and k are L2-normalised per head, so every score is
  a cosine in [-1, 1], multiplied by the temperature `model.cosine_scale` instead of 1/sqrt(H)."""

  options = attention.Attention.options + ('cosine_scale',)

  @classmethod
  def from_config(cls, cfg, *, rngs):
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, use_bias=cfg.use_bias,
               implementation=cfg.attention_impl, scale=cfg.cosine_scale, rngs=rngs)

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    super().check_config(model_cfg, data_cfg)
    options.positive('model.cosine_scale', model_cfg.get('cosine_scale'))

  def project(self, x, context=None):
    q, k, v = super().project(x, context)  # [B, T, N, H], [B, S, K, H], [B, S, K, H]
    unit = lambda t: t / jnp.maximum(jnp.linalg.norm(t, axis=-1, keepdims=True), 1e-6)  # noqa: E731
    return unit(q), unit(k), v


@pytest.fixture
def cosine_registered(monkeypatch):
  monkeypatch.setitem(attention_variants.VARIANTS, 'cosine', CosineAttention)


def cosine_config(data_dir, scale):
  config = quick_config(data_dir, steps=2, log_every=1, eval_every=2, checkpoint_every=2,
                        warmup_steps=0)
  config.model.attention = 'cosine'
  config.model.cosine_scale = scale
  return config


def test_unregistered_variant_is_refused_with_the_valid_names(data_dir):
  config = cosine_config(data_dir, 10.0)
  with pytest.raises(options.ConfigError, match=r"model.attention='cosine' is not valid"):
    validation.validate(config)


def test_the_variant_checks_its_own_option(data_dir, cosine_registered):
  del cosine_registered
  with pytest.raises(options.ConfigError, match=r'model.cosine_scale=-1.0 must be a positive'):
    validation.validate(cosine_config(data_dir, -1.0))


def test_a_registered_variant_trains_through_the_library(data_dir, tmp_path, cosine_registered):
  del cosine_registered
  config = cosine_config(data_dir, 10.0)
  validation.validate(config)
  loop.train_and_evaluate(config, str(tmp_path))
  rows = metric_rows(tmp_path)
  assert [r['step'] for r in rows] == [1, 2]
  assert all(jnp.isfinite(r['loss']) for r in rows)
  # The checkpoint restores into the variant: every self-attention layer is a CosineAttention.
  _, graphdef, variables, step = evaluation.load_run(str(tmp_path))
  layers = [m for _, m in nnx.iter_modules(nnx.merge(graphdef, variables))
            if isinstance(m, attention.Attention)]
  assert step == 2 and layers and all(isinstance(m, CosineAttention) for m in layers)
