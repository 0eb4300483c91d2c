"""Architectures are declared, not named: no library module outside models/ compares a string with
an architecture's name, and a new architecture, a prefix LM (Raffel et al. 2020, T5's "prefix LM":
a decoder-only model whose first P tokens attend to each other bidirectionally), defined here and
registered with one dict entry, validates, trains two steps, decodes with the KV cache and is
counted by models.accounting from what its class declares."""

import ast
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from configs import default
from layers import positions
from layers import sharding
from models import accounting
from models import decoder_only
from tests.helpers import ROOT
from tests.unit.test_decoding import full_and_cached_logits
from tests import helpers
from training import diagnostics
from training import loop
from training import state as state_lib
from training import validation

V = 23
LENGTH = 16
PREFIX = 5  # P: the prefix the test's config adds (model.prefix_length)
SPECIAL = models.SpecialIds(pad=0, bos=1, eos=2, sep=3, mask=4, first_word=5)

# --- No architecture named outside models/ ------------------------------------------------------

# The library outside models/: what may not compare a value with an architecture's name.
LIBRARY = ('layers', 'training', 'tools', 'data', 'train.py', 'eval.py')
BUILTIN_ARCHS = ('decoder_only', 'encoder_only', 'encoder_decoder', 'rnn_seq2seq')
# A name as a word, not inside a config file's path (configs/decoder_only.py in an example).
NAMED = re.compile(r'(?<![\w/])(' + '|'.join(BUILTIN_ARCHS) + r')(?![\w.])')
# (file, the string's start) a reader needs named, with the reason; keep it short.
ALLOWED = {}


def _library_files():
  for entry in LIBRARY:
    path = os.path.join(ROOT, entry)
    if entry.endswith('.py'):
      yield path
      continue
    for folder, _, files in os.walk(path):
      yield from (os.path.join(folder, f) for f in sorted(files) if f.endswith('.py'))


def _skipped(tree):
  """The ids of the string nodes that only document: docstrings and `help=` texts."""
  out = set()
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
      out.add(id(body[0].value))
    if isinstance(node, ast.keyword) and node.arg == 'help':
      out.update(id(n) for n in ast.walk(node.value))
    if isinstance(node, ast.Call) and getattr(node.func, 'attr', '').startswith('DEFINE_'):
      # absl flags: the help text is the third positional argument.
      out.update(id(n) for arg in node.args[2:3] for n in ast.walk(arg))
  return out


def named_architectures():
  """[(path, line, string)] of every string constant outside docstrings and help texts that names
  an architecture."""
  found = []
  for path in _library_files():
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    skipped = _skipped(tree)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in skipped and NAMED.search(node.value)):
        rel = os.path.relpath(path, ROOT)
        if not any(rel == file and node.value.startswith(start) for file, start in ALLOWED):
          found.append((rel, node.lineno, node.value))
  return found


def test_no_library_module_outside_models_names_an_architecture():
  """What varies by architecture is read from its `ArchSpec`; a name compared in training/,
  tools/, data/ or layers/ would be a missing declaration (and a new arch would skip the rule)."""
  assert named_architectures() == []


def test_the_check_finds_a_name():
  tree = "x = 1 if arch == 'encoder_only' else 2\nhelp_text = f'needs {a} not decoder_only'\n"
  hits = [n.value for n in ast.walk(ast.parse(tree))
          if isinstance(n, ast.Constant) and isinstance(n.value, str) and NAMED.search(n.value)]
  assert sorted(hits) == [' not decoder_only', 'encoder_only']
  assert not NAMED.search('e.g. --config=configs/decoder_only.py:quick')


# --- A prefix LM, declared and registered here ---------------------------------------------------

class PrefixVisible(positions.Position):
  """The position method of the stack, plus the prefix LM's mask: key j is visible to query i when
  j <= i or j < P (positions, so a packed row's segments each have their own prefix)."""

  def __init__(self, inner, prefix):
    self.inner = inner
    self.prefix = prefix

  def embed(self, x, positions):
    return self.inner.embed(x, positions)

  def check_length(self, length):
    self.inner.check_length(length)

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    q, k, terms = self.inner.in_attention(q, k, q_pos, k_pos, is_causal=is_causal)
    q_pos = jnp.arange(q.shape[1])[None] if q_pos is None else q_pos  # [B|1, T]
    k_pos = jnp.arange(k.shape[1])[None] if k_pos is None else k_pos  # [B|1, S]
    keys, queries = k_pos[:, None, None, :], q_pos[:, None, :, None]
    seen = (keys <= queries) | (keys < self.prefix)  # [B, 1, T, S]
    return q, k, dataclasses.replace(terms, mask=seen if terms.mask is None else terms.mask & seen)


class PrefixLM(decoder_only.DecoderOnly):
  """A decoder-only LM whose first `model.prefix_length` tokens see each other; every later token
  sees the prefix and the tokens before it. Decoding prefills the prefix (`init_cache`) and then
  steps token by token through the dense cache, which is causal past the prefix."""

  spec = models.ArchSpec(
      stacks=(models.StackSpec('decoder', causal=True),), batch_format='next_token',
      decoder='decoder', translation='prompt', documents=True, options=('prefix_length',))

  def __init__(self, cfg, vocab_size, max_length, *, rngs, special_ids=None):
    super().__init__(cfg, vocab_size, max_length, rngs=rngs, special_ids=special_ids)
    self.prefix = cfg.prefix_length
    self.decoder.position = PrefixVisible(self.decoder.position, self.prefix)

  def features(self, batch, *, rngs=None):
    # Not causal: the prefix mask (PrefixVisible) is the whole pattern.
    return self.decoder(batch['inputs'], segment_ids=batch.get('segment_ids'),
                        positions=batch.get('positions'), is_causal=False, rngs=rngs)

  def init_cache(self, batch, max_length, dtype=jnp.float32):
    """The cache with slots 0..P-1 filled from `batch['inputs'][:, :P]`, run bidirectionally."""
    cache = super().init_cache(batch, max_length, dtype)
    stack, p = self.decoder, self.prefix
    tokens = batch['inputs'][:, :p]  # [B, P]
    pos = jnp.broadcast_to(jnp.arange(p), tokens.shape)  # [B, P]
    x = stack.position.embed(stack.embed(tokens) * stack.embed_scale, pos)  # [B, P, D]
    filled = []
    for layer, c in zip(stack.block_list(), cache['self']):
      _, k, v, _ = layer.self_attention.prepare(layer._input(x, 'self'), positions=pos,
                                                position=stack.position)  # [B, P, K, H]
      filled.append({'k': c['k'].at[:, :p].set(k), 'v': c['v'].at[:, :p].set(v)})
      x = layer(x, positions=pos, is_causal=False, position=stack.position)
    return {**cache, 'self': filled}

  def decode_step(self, cache, tokens, index):
    """A step inside the prefix (a prompt fed from position 0, as models.decoding does) leaves
    the prefilled slots as they are; its logits are causal, those from P on the full model's."""
    logits, stepped = super().decode_step(cache, tokens, index)
    b = tokens.shape[0]
    inside = jnp.broadcast_to(jnp.asarray(index) < self.prefix, (b,))[:, None, None, None]
    kept = jax.tree.map(lambda old, new: jnp.where(inside, old, new), cache['self'],
                        stepped['self'])  # [B, S, K, H] each
    return logits, {**stepped, 'self': kept}


@pytest.fixture
def prefix_lm(monkeypatch):
  """'prefix_lm' in models.ARCHS for one test (monkeypatch restores the registry)."""
  monkeypatch.setitem(models.ARCHS, 'prefix_lm', PrefixLM)


def _config(prefix=PREFIX, **model):
  config = default.get_config('quick')
  config.model.update(arch='prefix_lm', position='rope', num_layers=2, d_model=32, num_heads=4,
                      num_kv_heads=2, d_ff=64)
  config.model.prefix_length = prefix  # the new arch's own field, in this copy of the config
  config.model.update(model)
  config.data.max_length = LENGTH
  config.train.update(batch_size=2, steps=2, warmup_steps=0)
  return validation.resolve(config)


def test_prefix_lm_trains_two_steps_through_the_training_step(prefix_lm):
  del prefix_lm
  config = _config()
  validation.validate(config)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  graphdef, tx, state = state_lib.create_state(config, V, mesh, special_ids=SPECIAL)
  with jax.set_mesh(mesh), sharding.use_rules(mesh, sharding.rules_of(config.mesh)):
    step = loop.jit_train_step(config, graphdef, tx, state, mesh,
                               diagnostics.param_groups(state['params'])[1])
    batch = helpers.random_batch(config, V, LENGTH)
    losses = []
    for _ in range(2):
      state, sums = step(state, batch)
      losses.append(float(sums['loss_sum']) / float(sums['weight_sum']))
  assert all(np.isfinite(losses)) and losses[1] < losses[0], losses


def _build(config):
  return models.build(config.model, V, LENGTH, rngs=nnx.Rngs(0))


def test_prefix_lm_attends_bidirectionally_in_the_prefix_and_causally_after(prefix_lm):
  """P = 0 is the causal decoder-only model with the same parameters; P = T sees the whole row;
  between, a change at j reaches every i < j inside the prefix and none after it."""
  del prefix_lm
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 1, V)  # [B, T]
  causal = models.build(_config(arch='decoder_only').model, V, LENGTH, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(_build(_config(prefix=0))({'inputs': tokens}),
                             causal({'inputs': tokens}), atol=1e-5)
  whole = _build(_config(prefix=12))
  bidirectional = whole.decoder(tokens, is_causal=False)  # the stack without the prefix mask
  np.testing.assert_allclose(whole.features({'inputs': tokens}), bidirectional, atol=1e-5)
  model = _build(_config())
  base = model({'inputs': tokens})  # [B, T, V]
  for j in (2, PREFIX + 2):
    changed = model({'inputs': tokens.at[:, j].set(tokens[:, j] % (V - 1) + 1)})
    moved = np.abs(np.asarray(changed - base)).max(axis=(0, 2))  # [T]
    if j < PREFIX:  # every prefix token sees j, later tokens too
      assert (moved[:PREFIX] > 1e-4).all() and (moved[PREFIX:] > 1e-4).all(), moved
    else:  # past the prefix only tokens at j and after see it
      assert (moved[:j] == 0).all() and (moved[j:] > 1e-4).all(), moved


def test_prefix_lm_cached_decoding_equals_the_full_forward(prefix_lm):
  """The prefix is prefilled by `init_cache`; fed from position 0 as models.decoding feeds a
  prompt, every token from P on gives the full forward's logits through the dense cached step."""
  del prefix_lm
  model = _build(_config())
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 1, V)  # [B, T]
  full, cached = full_and_cached_logits(model, {'inputs': tokens}, {'inputs': tokens},
                                        tokens)
  err = np.abs(np.asarray(cached[:, PREFIX:] - full[:, PREFIX:])).max()
  assert err < 2e-5, err
  # Before P a step sees only the tokens fed so far: the causal logits, not the prefix LM's.
  assert np.abs(np.asarray(cached[:, 0] - full[:, 0])).max() > 1e-3


def test_prefix_lm_is_counted_by_accounting(prefix_lm):
  del prefix_lm
  config = _config()
  model = _build(config)
  built = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  formula = accounting.formula_params(config.model, V, LENGTH)
  counted = accounting.counted_params(accounting.abstract_model(config.model, V, LENGTH))
  assert counted == formula and sum(formula.values()) == built
  assert accounting.kv_cache_per_token(config.model) == 2 * 2 * 2 * 8  # L x 2·K·H


def test_the_declarations_decide_what_prefix_lm_may_do(prefix_lm):
  """Refusals are computed from the registry: the new arch is refused where it declares nothing
  (a generated task needs a causal LM; expert choice reads later tokens of a causal stack)."""
  del prefix_lm
  config = _config()
  config.data.task = 'mqar'
  with pytest.raises(validation.ConfigError, match=r"^data.task='mqar' is a decoder_only task .*"
                     r"model.arch='prefix_lm' is not valid; valid: decoder_only$"):
    validation.validate(config)
  with pytest.raises(validation.ConfigError,
                     match=r"^model.moe_routing='experts'.*causal model.arch='prefix_lm'"):
    validation.validate(_config(moe_experts=2, moe_top_k=1, moe_routing='experts',
                                moe_capacity_factor=1.0))
  assert 'prefix_lm' in models.archs_where(lambda s: s.documents)
  assert 'prefix_lm' not in models.archs_where(lambda s: not s.causal and s.stacks)
