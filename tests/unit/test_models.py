"""Models: MLM masking statistics, each architecture's loss falls, eval.py translates every arch."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import encoder_only
from training import validation
from data import tokenizer as tokenizer_lib
from models import encoder_only as encoder_only_lib

IDS = encoder_only_lib.SpecialIds.from_tokenizer(tokenizer_lib.Tokenizer.from_words(['a', 'b']))


def test_special_ids_come_from_the_tokenizer():
  assert IDS == encoder_only_lib.SpecialIds(pad=tokenizer_lib.PAD, bos=tokenizer_lib.BOS,
                                            eos=tokenizer_lib.EOS, sep=tokenizer_lib.SEP,
                                            mask=tokenizer_lib.MASK, first_word=6)
  assert IDS.layout == (0, 1, 2, 3)  # <unk> (5) may be chosen: it stands for a word


def mlm_batch(b=512, t=40, vocab=50):
  rng = np.random.default_rng(0)
  inputs = rng.integers(6, vocab, (b, t)).astype(np.int32)
  lengths = rng.integers(10, t + 1, b)
  sep = rng.integers(3, 8, b)
  for i in range(b):
    inputs[i, 0], inputs[i, sep[i]], inputs[i, lengths[i] - 1] = (
        tokenizer_lib.BOS, tokenizer_lib.SEP, tokenizer_lib.EOS)
    inputs[i, lengths[i]:] = tokenizer_lib.PAD
  weights = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  return jnp.asarray(inputs), jnp.asarray(weights)


def test_mlm_masking_rates_and_specials():
  inputs, weights = mlm_batch()
  corrupted, chosen = encoder_only_lib.mlm_mask(jax.random.key(0), inputs, weights, 50,
                                                special_ids=IDS)
  inputs, corrupted, chosen = map(np.asarray, (inputs, corrupted, chosen))
  special = np.isin(inputs, IDS.layout)
  candidates = (np.asarray(weights) > 0) & ~special
  assert not chosen[~candidates].any()  # pad/bos/sep/eos never chosen
  np.testing.assert_array_equal(corrupted[~candidates], inputs[~candidates])
  n = chosen.sum()
  assert abs(n / candidates.sum() - 0.15) < 0.01, n / candidates.sum()
  sel = chosen > 0
  masked = (corrupted[sel] == tokenizer_lib.MASK).mean()
  kept = (corrupted[sel] == inputs[sel]).mean()
  random = 1 - masked - kept
  # The random word equals the original 1/44 of the time: those count as kept.
  assert abs(masked - 0.8) < 0.02 and abs(random - 0.1 * 43 / 44) < 0.015, (masked, random)
  assert (corrupted[sel & (corrupted != tokenizer_lib.MASK)] >= 6).all()  # random ids are words
  assert ((corrupted != inputs) <= sel).all()  # nothing changes outside the chosen positions


def test_mlm_target_rate_masks_whole_targets():
  inputs, weights = mlm_batch()
  corrupted, chosen = encoder_only_lib.mlm_mask(jax.random.key(1), inputs, weights, 50,
                                                special_ids=IDS, target_rate=0.5)
  inputs, corrupted, chosen = map(np.asarray, (inputs, corrupted, chosen))
  after_sep = np.cumsum(inputs == tokenizer_lib.SEP, 1) > 0
  target = after_sep & ~np.isin(inputs, IDS.layout) & (np.asarray(weights) > 0)
  whole = np.array([(corrupted[i][target[i]] == tokenizer_lib.MASK).all()
                    and (chosen[i] == target[i]).all() for i in range(len(inputs))])
  assert abs(whole.mean() - 0.5) < 0.07
  assert not chosen[np.isin(inputs, IDS.layout)].any()


def test_mlm_eval_masks_are_deterministic():
  config = validation.resolve(encoder_only.get_config('quick'))
  from flax import nnx
  import models
  model = models.build(config.model, 50, 40, rngs=nnx.Rngs(0), special_ids=IDS)
  inputs, weights = mlm_batch(b=8)
  batch = {'inputs': inputs, 'targets': inputs, 'weights': weights}
  a, b = model.loss_terms(batch), model.loss_terms(batch)
  np.testing.assert_array_equal(a[2], b[2])
  assert float(a[2].sum()) > 0
  c = model.loss_terms(batch, rngs=nnx.Rngs(dropout=1, mask=1))
  assert not np.array_equal(a[2], c[2])
  # Built without the ids, the forward pass runs (accounting, attention maps), masking refuses.
  bare = models.build(config.model, 50, 40, rngs=nnx.Rngs(0))
  assert bare(batch).shape == (8, 40, 50)
  with pytest.raises(ValueError, match='special_ids'):
    bare.loss_terms(batch)
