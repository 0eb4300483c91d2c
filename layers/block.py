"""The Transformer block: self-attention, optional cross-attention, feed-forward, and where the
norms sit (Pre-LN, Post-LN, DeepNorm, Sandwich-LN, ReZero)."""

import functools

import jax.numpy as jnp
from flax import nnx

from layers import attention
from layers import attention_variants
from layers import feed_forward
from layers import initializers
from layers import moe
from layers import norms
from layers import options

# Where the norm sits, keyed by `config.model.norm_position` (no options of their own), and whether
# the stack then ends with a final norm (models.stack): the placements that leave the residual
# stream un-normalised (pre, sandwich) need one; post and deepnorm end on a norm already; ReZero
# has no norm anywhere (Bachlechner et al. 2020).
NORM_POSITIONS = ('pre', 'post', 'deepnorm', 'sandwich', 'rezero')
FINAL_NORM = {'pre': True, 'post': False, 'deepnorm': False, 'sandwich': True, 'rezero': False}
# Which stack of which architecture a block is in, for DeepNorm's constants (`deepnorm_constants`).
DEEPNORM_ROLES = ('single', 'encoder', 'decoder')
# The projections DeepNorm's beta scales at initialisation: value and output of every attention,
# every feed-forward matrix; queries and keys keep theirs (Wang et al. 2022, Figure 2).
_DEEPNORM_ATTENTION = ('value', 'out')
_DEEPNORM_FFN = ('wi', 'wo', 'gate', 'up', 'down')
# model.deepnorm_scales: which of DeepNorm's two scalings apply (the second and third isolate one,
# as an ablation): both, alpha alone (beta 1: the standard init), beta alone (alpha 1: Post-LN's
# residual).
DEEPNORM_SCALES = ('alpha_beta', 'alpha', 'beta')


def deepnorm_constants(role, num_layers, num_decoder_layers=None):
  """DeepNorm's (alpha, beta) (Wang et al. 2022, "DeepNet", Figure 2).

  Args:
    role: 'single' (an encoder-only or decoder-only stack of N = `num_layers` layers):
      alpha = (2N)^(1/4), beta = (8N)^(-1/4); 'encoder' / 'decoder' of an encoder-decoder with
      N = `num_layers` encoder and M = `num_decoder_layers` decoder layers: encoder
      alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4),
      beta = (12M)^(-1/4).
    num_layers: N.
    num_decoder_layers: M (None: N).

  Returns:
    (alpha, the residual's weight; beta, the init scale of the value/output/FFN projections).
  """
  options.choice('deepnorm role', role, DEEPNORM_ROLES)
  n = float(num_layers)
  m = n if num_decoder_layers is None else float(num_decoder_layers)
  if role == 'single':
    return (2 * n) ** 0.25, (8 * n) ** -0.25
  if role == 'encoder':
    return 0.81 * (n ** 4 * m) ** (1 / 16), 0.87 * (n ** 4 * m) ** (-1 / 16)
  return (3 * m) ** 0.25, (12 * m) ** -0.25


def _scale_kernels(module, names, factor):
  """Multiplies the kernels of `module`'s sub-layers `names` (those it has) by `factor`."""
  for name in names:
    layer = getattr(module, name, None)
    kernel = getattr(layer, 'kernel', None)
    if isinstance(kernel, nnx.Variable):
      kernel.set_value(kernel.get_value() * factor)


class Block(nnx.Module):
  """One layer: each sublayer f (self-attention, cross-attention, feed-forward) joins the residual
  stream x by `config.model.norm_position`:

  - pre (Pre-LN, Xiong et al. 2020): x + f(norm(x)); the residual path is the identity, so
    gradients reach every layer unscaled and training is stable without warmup; the stack then
    needs a final norm.
  - post (Post-LN, Vaswani et al. 2017): norm(x + f(x)); the original, which at depth needs
    learning-rate warmup because the gradients near the output are large at initialisation. No
    final norm (the last block ends on one).
  - deepnorm (DeepNet, Wang et al. 2022): norm(alpha·x + f(x)), Post-LN with the residual
    up-weighted by alpha, and the value, output and feed-forward projections initialised scaled by
    beta (`deepnorm_constants`), which bounds the model update and trains Post-LN at depth. No
    final norm. `model.deepnorm_scales` keeps one of the two alone, as an ablation.
  - sandwich (Sandwich-LN, Ding et al. 2021, CogView): x + norm_out(f(norm(x))), Pre-LN plus a norm
    on each sublayer's output before the add, which keeps the residual stream's values from
    growing. Final norm, as Pre-LN.
  - rezero (ReZero, Bachlechner et al. 2020): x + g·f(x) with a scalar gate g per sublayer
    initialised at 0 (each block starts as the identity), and no norm at all, not at the end
    either.

  Dropout (model.dropout) acts on f's output before it joins the residual (after norm_out under
  sandwich, before the gate under rezero).

  Attributes:
    collect_stats: opt-in diagnostics (False by default, so the train step computes nothing
      extra): while True, each `__call__` sows {'act_rms', and for self-attention with
      `has_scores` 'attn_max_logit', 'attn_entropy', 'attn_sink_share'; under rezero
      'gate_self', 'gate_ffn' (and 'gate_cross'), the gates' values} as `nnx.Intermediate`
      'stats' (read them with `nnx.capture(..., nnx.Intermediate)` or
      `nnx.pop(model, nnx.Intermediate)`).
  """

  collect_stats = False

  def __init__(self, cfg, *, cross_attention=False, deepnorm=None, layer=None, rngs):
    """Args:
      cfg: `config.model` (d_model, num_heads, num_kv_heads, d_ff, norm, norm_position, ffn,
        attention, attention_impl, dropout, use_bias / attention_bias / ffn_bias, head_dim,
        kernel_init, attention_dropout, ffn_dropout, window).
      cross_attention: add a cross-attention sublayer (encoder-decoder decoders).
      deepnorm: (alpha, beta) under norm_position='deepnorm' (models.stack passes the stack's,
        `deepnorm_constants`); None: those of a single stack of `cfg.num_layers` layers.
      layer: this block's index in its stack: with `model.moe_experts` > 0 it decides whether the
        FFN is a `layers.moe.MoE` (`layers.moe.is_moe_layer`); None: dense. A self-attention
        variant that declares `takes_layer` gets it too (differential attention's depth).
      rngs: parameter initialisation.
    """
    options.choice('model.norm_position', cfg.norm_position, NORM_POSITIONS)
    self.norm_position = position = cfg.norm_position
    self.pre = position in ('pre', 'sandwich')  # the sublayer reads norm(x)
    make_norm = functools.partial(norms.make, cfg)
    variant = options.lookup('model.attention', attention_variants.VARIANTS, cfg.attention)
    sublayers = ('self', 'cross', 'ffn') if cross_attention else ('self', 'ffn')

    # Each variant reads its own options from `cfg`. Cross-attention stays dense, as in Longformer
    # and BigBird's encoder-decoders: the sparse patterns are defined on one sequence's positions.
    depth = {'layer': layer} if variant.takes_layer else {}  # only a variant that declares it
    self.self_attention = variant.from_config(cfg, rngs=rngs, **depth)
    self.cross_attention = (attention.Attention.from_config(cfg, rngs=rngs) if cross_attention
                            else None)
    self.ffn = moe.MoE.from_config(cfg, rngs=rngs) if moe.is_moe_layer(cfg, layer) else (
        feed_forward.make(cfg.ffn, cfg.d_model, cfg.d_ff, use_bias=initializers.ffn_bias(cfg),
                          kernel_init=initializers.kernel_init(cfg),
                          dropout=cfg.get('ffn_dropout', 0.0), rngs=rngs))
    for name in ('self', 'cross', 'ffn'):
      here = name in sublayers
      # The same names as before the other placements existed: pre/post checkpoints still load.
      setattr(self, f'{name}_norm', make_norm(cfg.d_model, rngs=rngs)
              if here and position != 'rezero' else None)
      if position == 'sandwich':
        setattr(self, f'{name}_out_norm', make_norm(cfg.d_model, rngs=rngs) if here else None)
      if position == 'rezero':
        setattr(self, f'{name}_gate', nnx.Param(jnp.zeros((), jnp.float32)) if here else None)
    self.alpha = 1.0
    if position == 'deepnorm':
      self.alpha, beta = deepnorm if deepnorm is not None else deepnorm_constants(
          'single', cfg.num_layers)
      scales = cfg.get('deepnorm_scales', 'alpha_beta')
      options.choice('model.deepnorm_scales', scales, DEEPNORM_SCALES)
      self.alpha = self.alpha if 'alpha' in scales else 1.0
      beta = beta if 'beta' in scales else 1.0
      for layer in (self.self_attention, self.cross_attention):
        if layer is not None:
          _scale_kernels(layer, _DEEPNORM_ATTENTION, beta)
      _scale_kernels(self.ffn, _DEEPNORM_FFN, beta)
    self.dropout = nnx.Dropout(cfg.dropout)

  def _sublayer(self, x, name, fn, rngs):
    """x joined with fn's output by the norm position; `name` is 'self', 'cross' or 'ffn'."""
    drop = lambda y: self.dropout(y, deterministic=rngs is None, rngs=rngs)
    position = self.norm_position
    if position == 'rezero':
      return x + getattr(self, f'{name}_gate')[...].astype(x.dtype) * drop(fn(x))
    norm = getattr(self, f'{name}_norm')
    if position == 'pre':
      return x + drop(fn(norm(x)))
    if position == 'sandwich':
      return x + drop(getattr(self, f'{name}_out_norm')(fn(norm(x))))
    # post (alpha 1) and deepnorm
    return norm(self.alpha * x + drop(fn(x)))

  def _input(self, x, name):
    """What sublayer `name` reads: norm(x) under pre and sandwich, x otherwise."""
    return getattr(self, f'{name}_norm')(x) if self.pre else x

  def gates(self):
    """{'gate_self': scalar, ...}: the ReZero gates ({} under the other placements)."""
    if self.norm_position != 'rezero':
      return {}
    return {f'gate_{name}': getattr(self, f'{name}_gate')[...]
            for name in ('self', 'cross', 'ffn') if getattr(self, f'{name}_gate') is not None}

  def __call__(self, x, *, segment_ids=None, positions=None, is_causal=False, position=None,
               context=None, context_segment_ids=None, rngs=None):
    """Args:
      x: `[B, T, D]`.
      segment_ids, positions: `[B, T]`.
      is_causal: causal self-attention (decoders).
      position: the `layers.positions` object, for methods acting inside attention.
      context: `[B, S, D]` encoder output for cross-attention, with `context_segment_ids` `[B, S]`.
      rngs: `nnx.Rngs` with a `dropout` stream while training, None for deterministic evaluation.

    Returns:
      `[B, T, D]`.
    """
    stats = {}
    # Attention dropout needs the rngs; variants without it take none (validation refuses it).
    drop = {'rngs': rngs} if getattr(self.self_attention, 'dropout_rate', 0.0) > 0 else {}

    def self_attend(h):
      if self.collect_stats and self.self_attention.has_scores:
        # The scores of this very input (after the norm under Pre-LN), from the layer itself.
        stats.update(self.self_attention.score_stats(
            h, segment_ids=segment_ids, positions=positions, is_causal=is_causal,
            position=position))
      return self.self_attention(h, segment_ids=segment_ids, positions=positions,
                                 is_causal=is_causal, position=position, **drop)

    x = self._sublayer(x, 'self', self_attend, rngs)
    if self.cross_attention is not None:
      # Cross-attention carries no position term (as in T5 and ALiBi's reference): alignment is
      # learned from content, and the encoder's positions are already in its outputs.
      cross_drop = {'rngs': rngs} if self.cross_attention.dropout_rate > 0 else {}
      x = self._sublayer(x, 'cross', lambda h: self.cross_attention(
          h, context, segment_ids=segment_ids, context_segment_ids=context_segment_ids,
          **cross_drop), rngs)
    y = self._sublayer(x, 'ffn', lambda h: self.ffn(h, rngs), rngs)
    if self.collect_stats:
      self.sow(nnx.Intermediate, 'stats', {'act_rms': activation_rms(y, segment_ids), **stats,
                                           **self.gates()})
    return y

  # --- KV cache path and attention maps (additive; `__call__` is unchanged) ----------------------

  def init_cache(self, batch_size, max_length, dtype):
    """This layer's self-attention cache {'k', 'v'} `[B, S_max, K, H]`."""
    return self.self_attention.init_cache(batch_size, max_length, dtype)

  def init_paged_cache(self, num_pages, page_size, dtype):
    """This layer's self-attention page pool {'k_pages', 'v_pages'} `[P, page_size, K, H]`."""
    return self.self_attention.init_paged_cache(num_pages, page_size, dtype)

  def decode(self, x, cache, index, *, position=None, context_cache=None, context_mask=None):
    """One decoding step (no dropout) of `x` `[B, 1, D]` at absolute positions `index` `[B]`.

    Args:
      x: `[B, 1, D]`.
      cache: this layer's self-attention cache (a paged one carries the 'block_table').
      index: `[B]` or scalar absolute positions.
      position: the `layers.positions` object.
      context_cache: this layer's cross-attention {'k', 'v'} of the encoder output (or None).
      context_mask: `[B, S]` True on real source tokens.

    Returns:
      (`[B, 1, D]`, the updated cache).
    """
    new = {}

    def self_attend(h):
      out, new['cache'] = self.self_attention.decode(h, cache, index, position=position)
      return out

    x = self._sublayer(x, 'self', self_attend, None)
    if self.cross_attention is not None:
      x = self._sublayer(x, 'cross', lambda h: self.cross_attention.decode_context(
          h, context_cache, context_mask), None)
    # An MoE FFN's step routes dropless and sows nothing (layers.moe.MoE.decode).
    ffn = getattr(self.ffn, 'decode', self.ffn)
    return self._sublayer(x, 'ffn', ffn, None), new['cache']

  def attention_weights(self, x, *, segment_ids=None, positions=None, is_causal=False,
                        position=None, context=None, context_segment_ids=None):
    """Returns ({'self': `[B, N, T, T]`, 'cross': `[B, N, T, S]` (if any)}, the layer's output)."""
    maps = {}
    maps['self'] = self.self_attention.weights(
        self._input(x, 'self'), segment_ids=segment_ids, positions=positions, is_causal=is_causal,
        position=position)
    x = self._sublayer(x, 'self', lambda h: self.self_attention(
        h, segment_ids=segment_ids, positions=positions, is_causal=is_causal,
        position=position), None)
    if self.cross_attention is not None:
      maps['cross'] = self.cross_attention.weights(self._input(x, 'cross'), context,
                                                   segment_ids=segment_ids,
                                                   context_segment_ids=context_segment_ids)
      x = self._sublayer(x, 'cross', lambda h: self.cross_attention(
          h, context, segment_ids=segment_ids, context_segment_ids=context_segment_ids), None)
    return maps, self._sublayer(x, 'ffn', self.ffn, None)


def activation_rms(y, segment_ids=None):
  """The root mean square of `y` `[B, T, D]` over the real tokens (segment id > 0, or all)."""
  real = (jnp.ones(y.shape[:2], jnp.float32) if segment_ids is None
          else (segment_ids > 0).astype(jnp.float32))  # [B, T]
  count = jnp.maximum(jnp.sum(real), 1.0)
  return jnp.sqrt(jnp.sum(jnp.mean(jnp.square(y.astype(jnp.float32)), -1) * real) / count)
