"""A stack of Transformer blocks over token embeddings: the body of every Transformer model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import block
from layers import initializers
from layers import norms
from layers import paged_attention
from layers import sharding
from layers import positions as positions_lib

# What a scanned block keeps for its backward pass (`config.model.remat`); the rest is recomputed.
# A policy of None means no `jax.checkpoint` at all.
REMAT_POLICIES = {
    'none': None,  # keep every intermediate (fastest, most memory)
    'full': jax.checkpoint_policies.nothing_saveable,  # keep only each block's input
    # keep the weight matmuls' outputs (projections, FFN), recompute the rest (norms, softmax)
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
LAYERS_AXIS = 'layers'  # logical name of a scanned stack's leading axis (no rule: replicated)
# `config.model.embed_scale`: what the token embedding is multiplied by on the way in, its
# initial standard deviation and what tied logits h·E^T are multiplied by (D = d_model).
EMBED_SCALES = ('sqrt_d', 'none', 'plain')


def embed_scales(cfg):
  """(input multiplier, init std, tied logit multiplier) of `model.embed_scale`: sqrt_d
  (sqrt(D), 1/sqrt(D), 1), none (1, 1, 1/sqrt(D): the Flax examples) or plain (1, 0.02, 1: HF
  GPT-2, Llama, Qwen; 0.02 is GPT-2's initializer_range)."""
  root = math.sqrt(cfg.d_model)
  return {'sqrt_d': (root, 1.0 / root, 1.0), 'none': (1.0, 1.0, 1.0 / root),
          'plain': (1.0, 0.02, 1.0)}[cfg.get('embed_scale', 'sqrt_d')]


def softcap(logits, cap):
  """`cap`·tanh(`logits` / `cap`): Gemma 2's final logit soft-capping (Gemma Team 2024), which
  keeps every logit in (-cap, cap) and leaves those far below the cap nearly unchanged; `cap` 0
  returns `logits` as they are."""
  if not cap:
    return logits
  return cap * jnp.tanh(logits / cap)


def deepnorm_role(cfg, cross_attention):
  """Which DeepNorm constants a stack takes (layers.block.deepnorm_constants): the encoder or the
  decoder of an encoder-decoder, or the single stack of the other archs."""
  if cfg.get('arch') == 'encoder_decoder':
    return 'decoder' if cross_attention else 'encoder'
  return 'single'


def pattern_entries(cfg):
  """The entries of `model.layer_pattern` ('linear, dense' -> ('linear', 'dense')); () if unset."""
  pattern = cfg.get('layer_pattern', '')
  return tuple(entry.strip() for entry in pattern.split(',')) if pattern else ()


def layer_attentions(cfg):
  """The self-attention variant of each of a stack's `num_layers` layers: `model.layer_pattern`
  repeated (layer i takes entry i mod its length; Qwen3-Next's 'linear,linear,linear,dense' is
  three linear layers to one dense), or `model.attention` everywhere when the pattern is ''."""
  entries = pattern_entries(cfg) or (cfg.attention,)
  return tuple(entries[i % len(entries)] for i in range(cfg.num_layers))


def layer_config(cfg, stream, layer):
  """`cfg` with the attention variant (`layer_attentions`) and the attention seed of layer `layer`
  of stack `stream`: random draws differ across layers and stacks, and stay a function of
  `model.attention_seed`."""
  hybrid = bool(pattern_entries(cfg))
  if 'attention_seed' not in cfg and not hybrid:
    return cfg
  out = cfg.copy_and_resolve_references()
  if hybrid:
    out.attention = layer_attentions(cfg)[layer]
  if 'attention_seed' in cfg:
    out.attention_seed = int(np.random.SeedSequence([cfg.attention_seed, stream, layer])
                             .generate_state(1)[0])
  return out


def scanned_config(cfg):
  """`cfg` for a scanned stack's one traced block: a pattern's single variant as the attention
  (a pattern of several variants cannot share one trace; validation refuses it with scan)."""
  if not pattern_entries(cfg):
    return cfg
  out = cfg.copy_and_resolve_references()
  out.attention = layer_attentions(cfg)[0]
  return out


class Stack(nnx.Module):
  """Embeds tokens, adds positions, runs `num_layers` blocks and (pre, sandwich) a final norm.

  Whether a final norm closes the stack follows the norm position (layers.block.FINAL_NORM): Pre-LN
  and Sandwich-LN leave the residual stream un-normalised and add one; Post-LN and DeepNorm end
  every block on a norm and add none; ReZero has no norm anywhere.

  The token embedding enters scaled by sqrt(D) (`embed_scale='sqrt_d'`, initialised with std
  1/sqrt(D)) or unscaled (`'none'`, initialised with std 1, as the Flax lm1b/wmt examples): either
  way its rows start at unit variance; `'plain'` is unscaled with std 0.02 (HF GPT-2, Llama, Qwen).
  A stack built with `output=True` also owns the logits (`logits`): tied to the embedding
  (`tie_output`, the default; divided by sqrt(D) under `embed_scale='none'`, as the Flax
  examples' shared-embedding logits) or an untied `nnx.Linear(D, V)`, with a bias unless
  `output_bias` is False (the Flax examples' `logits_via_embedding=False`), then soft-capped
  (`final_logit_softcap` c > 0: c·tanh(logits / c), `softcap`).
  """

  def __init__(self, cfg, vocab_size, max_length, *, cross_attention=False, embed=None, stream=0,
               output=False, rngs):
    """Args:
      cfg: `config.model`.
      vocab_size: V.
      max_length: longest sequence the position method must represent (learned tables).
      cross_attention: blocks attend to a context (encoder-decoder decoder).
      embed: an `nnx.Embed` to share (tied encoder/decoder embeddings), or None for a new one.
      stream: which stack of the model this is (0, 1, ...): with the layer index it gives every
        layer its own `attention_seed` (BigBird's random blocks, the Performer's features).
      output: this stack computes the logits (`logits`); an untied output layer is built here.
      rngs: parameter initialisation.
    """
    self.d_model = cfg.d_model
    # sqrt_d and none: unit-variance rows after the scale, so token and position signals are
    # comparable; tied logits h·E^T with unit-variance rows (none) divided by sqrt(D), so that
    # they start at the scale of the sqrt_d model's (whose rows have variance 1/D).
    self.embed_scale, std, self.logit_scale = embed_scales(cfg)
    self.embed = embed if embed is not None else nnx.Embed(
        vocab_size, cfg.d_model, rngs=rngs,
        embedding_init=sharding.partitioned(nnx.initializers.normal(stddev=std), 'vocab', 'embed'))
    self.final_logit_softcap = float(cfg.get('final_logit_softcap', 0.0))  # 0 = none
    self.position = positions_lib.make(cfg, max_length, rngs=rngs)
    self.random_positions_max = cfg.get('random_positions_max', 0)  # Ruoss et al.; 0 = off
    self.num_layers = cfg.num_layers
    self.scan_layers = cfg.get('scan_layers', False)
    self.remat = cfg.get('remat', 'none')
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'remat {self.remat!r} unknown; valid: {sorted(REMAT_POLICIES)}')
    # An encoder-decoder's encoder and decoder have num_layers layers each (N = M).
    deepnorm = (block.deepnorm_constants(deepnorm_role(cfg, cross_attention), cfg.num_layers)
                if cfg.norm_position == 'deepnorm' else None)
    if self.scan_layers:
      # One Block whose variables are the layers' stacked on a leading [L] axis. All layers share
      # one config, so the per-layer `attention_seed` cannot apply (training.validation refuses the
      # variants that read it), nor a pattern of several variants (validation refuses both).
      self.blocks = stacked_blocks(scanned_config(cfg), cfg.num_layers,
                                   cross_attention=cross_attention, deepnorm=deepnorm, rngs=rngs)
    else:
      self.blocks = nnx.List([
          block.Block(layer_config(cfg, stream, i), cross_attention=cross_attention,
                      deepnorm=deepnorm, layer=i, rngs=rngs)
          for i in range(cfg.num_layers)])
    self.final_norm = (norms.make(cfg, cfg.d_model, rngs=rngs)
                       if block.FINAL_NORM[cfg.norm_position] else None)
    self.dropout = nnx.Dropout(cfg.dropout)
    # Built last, so the other parameters draw the same values as the tied model's.
    self.output = nnx.Linear(
        cfg.d_model, vocab_size, use_bias=cfg.get('output_bias', True), rngs=rngs,
        kernel_init=sharding.partitioned(initializers.kernel_init(cfg), 'embed', 'vocab'),
        bias_init=sharding.partitioned(nnx.initializers.zeros, 'vocab'),
    ) if output and not cfg.get('tie_output', True) else None

  def __call__(self, tokens, *, segment_ids=None, positions=None, is_causal=False, context=None,
               context_segment_ids=None, rngs=None):
    """Args:
      tokens: `[B, T]` int.
      segment_ids: `[B, T]` (0 = padding) or None.
      positions: `[B, T]` or None for 0..T-1.
      is_causal, context, context_segment_ids, rngs: see `layers.block.Block`.

    Returns:
      `[B, T, D]` hidden states.
    """
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [B, T]
    if self.random_positions_max and rngs is not None:  # training only: evaluation sees 0..T-1
      positions = positions_lib.random_positions(rngs.dropout(), positions,
                                                 self.random_positions_max)
    x = self.embed(tokens) * self.embed_scale  # [B, T, D]
    # The residual stream in the parameters' dtype (the compute dtype: bfloat16 under
    # train.compute_dtype), whatever the scale's and the position table's dtypes.
    x = self.position.embed(x, positions).astype(self.embed.embedding.dtype)
    x = self.dropout(x, deterministic=rngs is None, rngs=rngs)
    names = ('batch', 'length', 'act_embed')  # the residual stream (layers.sharding)
    x = sharding.constrain(x, names)
    kwargs = dict(segment_ids=segment_ids, positions=positions, is_causal=is_causal,
                  position=self.position, context=context, context_segment_ids=context_segment_ids)
    if self.scan_layers:
      x = self._scan(x, names, rngs, kwargs)
    else:
      for layer in self.blocks:
        x = sharding.constrain(layer(x, rngs=rngs, **kwargs), names)
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x

  def logits(self, h):
    """`[..., V]` float32 logits of hidden states `h` `[..., D]` (a stack built
    with output=True), soft-capped in float32 when `final_logit_softcap` > 0."""
    if self.output is not None:
      logits = self.output(h).astype(jnp.float32)  # [..., V]
    else:
      logits = (self.embed.attend(h) * self.logit_scale).astype(jnp.float32)  # [..., V]
    return softcap(logits, self.final_logit_softcap)

  def output_table(self):
    """`[V, D]` the tied output projection, scale included: `logits(h) = h @ output_table().T`
    (then soft-capped by `final_logit_softcap`, if set).

    Raises:
      ValueError: the output is untied (it has a bias, which a bare table cannot carry).
    """
    if self.output is not None:
      raise ValueError('model.tie_output=False: the output layer has a bias; use logits(h)')
    table = self.embed.embedding[...]
    return table if self.logit_scale == 1.0 else table * self.logit_scale

  def _scan(self, x, names, rngs, kwargs):
    """Runs the stacked blocks with one `jax.lax.scan`: the block is traced and compiled once
    whatever the depth, and (remat) its body is recomputed in the backward pass by its policy."""
    graphdef, state = nnx.split(self.blocks)
    # A dropout key per layer, as the unrolled layers each draw their own.
    keys = None if rngs is None else jax.random.split(rngs.dropout(), self.num_layers)  # [L]

    def body(x, layer):
      layer_state, key = layer
      y = nnx.merge(graphdef, layer_state)(
          x, rngs=None if key is None else nnx.Rngs(dropout=key), **kwargs)
      return sharding.constrain(y, names), None

    policy = REMAT_POLICIES[self.remat]
    if policy is not None:
      # prevent_cse=False: inside scan the recomputation cannot be merged with the forward pass
      # anyway, and the CSE barriers would only slow it down (jax.checkpoint's docs).
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, (state, keys))
    return x

  def block_list(self):
    """The layers as a list of `Block`s; a scanned stack's are views of layer i's slices."""
    if not self.scan_layers:
      return list(self.blocks)
    graphdef, state = nnx.split(self.blocks)
    return [nnx.merge(graphdef, _map_variables(state, lambda v, i=i: _unstack(v, i)))
            for i in range(self.num_layers)]

  def unroll(self):
    """Makes a scanned stack unrolled in place (`blocks` a list of per-layer `Block`s holding the
    slices): for passes that need each layer's own module (training.diagnostics.diagnostic_pass)."""
    if self.scan_layers:
      self.blocks = nnx.List(self.block_list())
      self.scan_layers = False

  # --- KV cache path and attention maps (additive; `__call__` is unchanged) ----------------------

  def init_cache(self, batch_size, max_length, dtype=jnp.float32, *, page_size=None,
                 num_pages=None):
    """Per-layer self-attention caches: a list of {'k', 'v'} `[B, S_max, K, H]`, or with
    `page_size` a list of page pools {'k_pages', 'v_pages'} `[P, page_size, K, H]`
    (layers.paged_attention; P = `num_pages`, default enough for every row at `max_length`).

    Raises ValueError if the position method cannot represent `max_length` positions.
    """
    self.position.check_length(max_length)
    if page_size is None:
      return [layer.init_cache(batch_size, max_length, dtype) for layer in self.block_list()]
    if num_pages is None:
      num_pages = paged_attention.default_num_pages(batch_size, max_length, page_size)
    return [layer.init_paged_cache(num_pages, page_size, dtype) for layer in self.block_list()]

  def context_cache(self, context):
    """Per-layer cross-attention keys/values of an encoder output `[B, S, D]` (computed once)."""
    return [layer.cross_attention.context_cache(context) for layer in self.block_list()]

  def decode(self, tokens, index, cache, *, context_cache=None, context_mask=None,
             block_table=None):
    """One causal decoding step.

    Args:
      tokens: `[B]` int, each row's token at absolute position `index`.
      index: `[B]` or scalar int.
      cache: from `init_cache`.
      context_cache, context_mask: from `context_cache` and `[B, S]` (encoder-decoder).
      block_table: `[B, max_pages]` int32 for a paged cache (one table for every layer's pool).

    Returns:
      (`[B, D]` hidden state, the updated cache).
    """
    b = tokens.shape[0]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))  # [B]
    x = self.embed(tokens[:, None]) * self.embed_scale  # [B, 1, D]
    x = self.position.embed(x, index[:, None])
    new_cache = []
    # A scanned stack decodes layer by layer on slices of its variables: the cache stays a list.
    for i, layer in enumerate(self.block_list()):
      # Each layer sees its own pool with the shared table; only the pools come back.
      layer_cache = cache[i] if block_table is None else {**cache[i], 'block_table': block_table}
      x, c = layer.decode(x, layer_cache, index, position=self.position,
                          context_cache=None if context_cache is None else context_cache[i],
                          context_mask=context_mask)
      new_cache.append(c if block_table is None else
                       {k: a for k, a in c.items() if k != 'block_table'})
    if self.final_norm is not None:
      x = self.final_norm(x)
    return x[:, 0], new_cache

  def attention_weights(self, tokens, *, segment_ids=None, positions=None, is_causal=False,
                        context=None, context_segment_ids=None):
    """Each layer's attention probabilities: a list of {'self': `[B, N, T, T]`, 'cross': ...}."""
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [B, T]
    x = self.embed(tokens) * self.embed_scale  # [B, T, D]
    x = self.position.embed(x, positions)
    maps = []
    for layer in self.block_list():
      m, x = layer.attention_weights(x, segment_ids=segment_ids, positions=positions,
                                     is_causal=is_causal, position=self.position, context=context,
                                     context_segment_ids=context_segment_ids)
      maps.append(m)
    return maps


def _map_variables(state, fn):
  """`state` with every `nnx.Variable` replaced by `fn(variable)`."""
  return jax.tree.map(fn, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _stack_axes(v):
  """A stacked variable: its logical axes get the leading `layers` name (layers.sharding)."""
  names = v.get_metadata().get('logical_axes')
  if names is None:
    return v
  return v.replace(v.get_value(), logical_axes=(LAYERS_AXIS,) + tuple(names))


def _unstack(v, i):
  """Layer `i`'s slice of a stacked variable, with its per-layer logical axes."""
  names = v.get_metadata().get('logical_axes')
  kwargs = {} if names is None else {'logical_axes': tuple(names)[1:]}
  return v.replace(v.get_value()[i], **kwargs)


def stacked_blocks(cfg, num_layers, *, cross_attention, deepnorm=None, rngs):
  """`num_layers` blocks as one `Block` whose variables have a leading `[L]` axis (named
  `layers`), built by vmapping the constructor over L split parameter keys (flax's "scan over
  layers"). Layer i of it is a `Block` with `jax.tree.map(lambda a: a[i], ...)` of its state."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs):
    return block.Block(cfg, cross_attention=cross_attention, deepnorm=deepnorm, rngs=rngs)

  blocks = make(rngs)
  graphdef, state = nnx.split(blocks)
  return nnx.merge(graphdef, _map_variables(state, _stack_axes))


def stack_layer_states(states):
  """Per-layer `Block` states (an unrolled stack's `nnx.state(blocks[i])`) -> the state of a
  scanned stack's `blocks`: every variable stacked on a leading `[L]` axis named `layers`."""
  return jax.tree.map(
      lambda *vs: _stack_axes(vs[0].replace(jnp.stack([v.get_value() for v in vs]))), *states,
      is_leaf=lambda v: isinstance(v, nnx.Variable))
