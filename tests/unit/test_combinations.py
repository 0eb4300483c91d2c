"""Every attention variant x kernel x position method: refused at validation in one line, or it
trains two steps and tools.accounting counts its parameters as the model has them. Nothing in
between ends in a traceback. Each per-layer option (the output gate, QK-norm, the logit soft cap,
the sinks) is accepted for a variant and kernel exactly where they declare it. (Cached decoding
equals the full forward pass for every position and variant in tests/unit/test_decoding.py and
test_relative_positions.py; eval.py refuses a decoder with no cached step,
tests/unit/test_open_contract.py.)"""

import jax
import numpy as np
import pytest

import models
from configs import default
from layers import attention
from layers import attention_variants
from layers import options
from layers import positions
from layers import sharding
from models import accounting
from tests import helpers
from training import diagnostics
from training import loop
from training import state as state_lib
from training import validation

V = 23
LENGTH = 16
SPECIAL = models.SpecialIds(pad=0, bos=1, eos=2, sep=3, mask=4, first_word=5)  # encoder_only's


def combination(variant, impl, position):
  """A one-layer config of the combination (encoder_only for a variant with no causal form; a
  sequence axis of 2 for a kernel that needs one; GQA with the heads in the variant's multiples)."""
  config = default.get_config('quick')
  m = config.model
  cls = attention_variants.VARIANTS[variant]
  m.update(arch='decoder_only' if cls.supports_causal else 'encoder_only', attention=variant,
           attention_impl=impl, position=position, num_layers=1, d_model=16,
           num_heads=2 * cls.head_multiple, num_kv_heads=cls.head_multiple, d_ff=32, window=2,
           global_tokens=(0,), bigbird_block=4, bigbird_random_blocks=1, linformer_k=4,
           performer_features=8)
  config.data.max_length = LENGTH
  config.train.update(batch_size=2, steps=2, warmup_steps=0)
  if attention.KERNELS[impl].sequence_mesh == 'needed':
    config.mesh.sequence = 2
  return validation.resolve(config)


def outcomes():
  """{(variant, impl, position): None (accepted) or the refusal}; any other exception propagates."""
  out = {}
  for variant in sorted(attention_variants.VARIANTS):
    for impl in sorted(attention.KERNELS):
      for position in sorted(positions.POSITIONS):
        try:
          validation.validate(combination(variant, impl, position))
          out[variant, impl, position] = None
        except options.ConfigError as e:
          out[variant, impl, position] = str(e)
  return out


OUTCOMES = outcomes()
ACCEPTED = sorted(k for k, v in OUTCOMES.items() if v is None)


def test_every_refusal_is_one_line_naming_a_field():
  refused = {k: v for k, v in OUTCOMES.items() if v is not None}
  assert refused and ACCEPTED
  for key, message in refused.items():
    assert '\n' not in message and message.startswith(('model.', 'mesh.')), (key, message)
    assert 'valid' in message, (key, message)
  # The declarations, not a list, decide; spot checks of what they must give.
  assert ('dense', 'xla', 'fire') in ACCEPTED and ('dense', 'ring', 'alibi') in ACCEPTED
  assert OUTCOMES['dense', 'pallas', 'kerple'] and OUTCOMES['dense', 'ring', 't5_bias']
  assert OUTCOMES['linear', 'pallas', 'rope'] and OUTCOMES['longformer', 'xla', 'alibi']


def covering(cells):
  """A few of `cells` holding each (variant, kernel), (variant, position) and (kernel, position)
  pair that any of them holds (greedy: the cell adding the most pairs not yet held, the first in
  sorted order on a tie)."""
  def pairs(cell):
    variant, impl, position = cell
    return {('kernel', variant, impl), ('position', variant, position), ('both', impl, position)}
  left, chosen = set().union(*map(pairs, cells)), []
  while left:
    best = max(sorted(cells), key=lambda c: len(pairs(c) & left))
    chosen.append(best)
    left -= pairs(best)
  return sorted(chosen)


# CI trains the covering cells; the other accepted cells train under `--slow` and are traced and
# lowered in CI (test_every_other_accepted_combination_lowers).
TRAINED = covering(ACCEPTED)
LOWERED = sorted(set(ACCEPTED) - set(TRAINED))


def test_the_trained_cells_cover_every_pair():
  for a, b in ((0, 1), (0, 2), (1, 2)):
    assert {(c[a], c[b]) for c in TRAINED} == {(c[a], c[b]) for c in ACCEPTED}
  assert len(TRAINED) < len(ACCEPTED)


def _step(variant, impl, position, abstract=False):
  """(config, mesh, state, the jitted train step, a batch) of the combination; with `abstract`
  the state is shapes only (nothing computed)."""
  config = combination(variant, impl, position)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:config.mesh.sequence])
  graphdef, tx, state = (state_lib.abstract_state if abstract else state_lib.create_state)(
      config, V, mesh, special_ids=SPECIAL)
  step = loop.jit_train_step(config, graphdef, tx, state, mesh,
                             diagnostics.param_groups(state['params'])[1],
                             compiler_options=helpers.QUICK_COMPILE)
  return config, mesh, state, step, helpers.random_batch(config, V, LENGTH)


@pytest.mark.parametrize('variant,impl,position', TRAINED + [
    pytest.param(*cell, marks=pytest.mark.slow) for cell in LOWERED])
def test_an_accepted_combination_trains_and_is_counted(variant, impl, position):
  """Two steps: each advances the step counter and changes the parameters, with a finite loss."""
  config, mesh, state, step, batch = _step(variant, impl, position)
  with jax.set_mesh(mesh), sharding.use_rules(mesh, sharding.rules_of(config.mesh)):
    for expected in (1, 2):
      before = [np.array(x) for x in jax.tree.leaves(state['params'])]
      state, sums = step(state, batch)
      assert np.isfinite(float(sums['loss_sum'])), (variant, impl, position)
      assert int(state['step']) == expected
      after = jax.tree.leaves(state['params'])
      moved = [not np.array_equal(a, b) for a, b in zip(before, after)]
      assert all(moved), (variant, impl, position, sum(moved), len(moved))
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, LENGTH))
  assert counted == accounting.formula_params(config.model, V, LENGTH)


@pytest.mark.parametrize('variant,impl,position', LOWERED)
def test_every_other_accepted_combination_lowers(variant, impl, position):
  """The accepted cells CI does not train: their train step traces and lowers (not compiled), and
  tools.accounting counts them."""
  config, mesh, state, step, batch = _step(variant, impl, position, abstract=True)
  with jax.set_mesh(mesh), sharding.use_rules(mesh, sharding.rules_of(config.mesh)):
    text = step.trace(state, batch).lower().as_text()
  assert 'stablehlo.dot_general' in text
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, LENGTH))
  assert counted == accounting.formula_params(config.model, V, LENGTH)


# The per-layer options every variant either applies or refuses by declaration (gates_output,
# norms_qk, layer_terms), at a value that turns each on.
LAYER_OPTIONS = {'attention_gate': 'elementwise', 'qk_norm': 'rmsnorm', 'attn_logit_softcap': 5.0,
                 'attention_sinks': True}


def option_outcomes():
  """{(variant, impl, option): None (accepted) or the refusal}, at RoPE (every variant takes it or
  nope); validation only, nothing is built."""
  out = {}
  for variant in sorted(attention_variants.VARIANTS):
    for impl in sorted(attention.KERNELS):
      for option, value in LAYER_OPTIONS.items():
        config = combination(variant, impl, 'rope')
        config.model[option] = value
        try:
          validation.validate(config)
          out[variant, impl, option] = None
        except options.ConfigError as e:
          out[variant, impl, option] = str(e)
  return out


def test_each_layer_option_is_applied_or_refused_in_one_line_for_every_variant_and_kernel():
  """Wherever the combination itself is valid, a layer option is accepted exactly where the
  variant declares it and (for the softmax terms) the kernel takes it; a refusal names the option
  and the valid values."""
  options = option_outcomes()
  for (variant, impl, option), message in options.items():
    if OUTCOMES[variant, impl, 'rope'] is not None:
      continue  # the combination is refused without the option
    cls = attention_variants.VARIANTS[variant]
    declared = {'attention_gate': cls.gates_output, 'qk_norm': cls.norms_qk,
                'attn_logit_softcap': 'softcap' in cls.layer_terms and (
                    not cls.uses_kernel or 'softcap' in attention.KERNELS[impl].terms),
                'attention_sinks': 'sinks' in cls.layer_terms and (
                    not cls.uses_kernel or 'sinks' in attention.KERNELS[impl].terms)}[option]
    assert (message is None) == bool(declared), (variant, impl, option, message)
    if message is not None:
      assert '\n' not in message and message.startswith(f'model.{option}='), message
      assert 'valid' in message, message
  # Spot checks of what the declarations must give.
  assert options['dense', 'pallas', 'attention_sinks'] is None
  assert options['mla', 'xla', 'attention_gate'] is None
  assert options['gated_deltanet', 'xla', 'qk_norm'] and options['linear', 'xla',
                                                                  'attention_sinks']
