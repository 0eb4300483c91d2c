"""Multi-head attention: the NNX layer; its cached steps are in attention_cache, the kernels in
attention_kernels."""

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from layers import attention_cache
from layers import attention_heads
from layers import attention_kernels
from layers import attention_xla
from layers import contract
from layers import initializers
from layers import masks
from layers import options
from layers import sharding

# Re-exported: the kernels' contract and table live in attention_kernels.
KERNELS = attention_kernels.KERNELS
DEFAULT_KERNEL = attention_kernels.DEFAULT
dot_product_attention = attention_kernels.dot_product_attention
kernels_taking = attention_kernels.kernels_taking
target_platform = attention_kernels.target_platform
compiling_for = attention_kernels.compiling_for

# The ScoreTerms fields the layer sets itself (`Attention.layer_terms`), and the option of each.
LAYER_TERMS = {'softcap': 'attn_logit_softcap', 'sinks': 'attention_sinks'}

# The projection options only `Attention.from_config` passes on (head_dim, attention_bias,
# attention_dropout, kernel_init); a variant with its own `from_config` does not read them yet.
PROJECTION_OPTIONS = ('head_dim', 'attention_bias', 'attention_dropout', 'kernel_init')


def projection_params(d_model, num_heads, num_kv_heads=None, *, use_bias=False, head_dim=None,
                      out_bias=True):
  """q, k, v, o projections: D·N·H + 2·D·K·H + N·H·D (+ N·H + 2·K·H + D biases; the output's D
  only with `out_bias`, model.attention_out_bias).

  With N·H = D that is 4·D² for MHA (K = N) and 2·D² + 2·D·K·H for GQA/MQA: how the D columns are
  split into heads does not change the count, only K does. `head_dim` None is H = D / N.
  """
  k = num_heads if num_kv_heads is None else num_kv_heads
  h = d_model // num_heads if head_dim is None else head_dim
  weights = 2 * d_model * num_heads * h + 2 * d_model * k * h
  return weights + (num_heads * h + 2 * k * h + (d_model if out_bias else 0) if use_bias else 0)


class Attention(attention_cache.CachedSteps, nnx.Module, options.Configurable):
  """Multi-head attention with `num_kv_heads` key/value heads (MHA, GQA, MQA) and q/k/v/o
  projections.

  Self-attention when called with one input, cross-attention with a `context` (queries from `x`,
  keys/values from `context`). Positions that act inside attention (RoPE, ALiBi, T5 bias) come in
  through `position`, an object of `layers.positions` that may rotate q/k or add a score term.

  The registered variants (layers.attention_variants.VARIANTS) subclass this one and declare what
  they can do in the class attributes below; nothing outside the layer infers it from the methods
  a subclass overrides or the attributes it has. A new variant that changes the attention pattern
  sets the ones it does not support to False.

  Attributes:
    has_scores: the layer's softmax runs over the `[T, S]` scores of its own q/k projections,
      `local_window_size` applied (attention_xla.scores): `score_stats` gives the training
      diagnostics its max logit and entropy. False for the sparse patterns, kernels and low-rank
      projections, whose diagnostics are the activation RMS only.
    takes_score_terms: position methods that add to the scores (`layers.contract.ScoreTerms`:
      ALiBi, T5 bias, FIRE, KERPLE, xPos's blocks) can be used.
    uses_kernel: the layer's softmax runs through `dot_product_attention` with the kernel
      `config.model.attention_impl` (the KERNELS table); False where the variant computes its
      attention its own way and would ignore the setting.
    supports_causal: causal self-attention (decoders) is possible.
    supports_bidirectional: an encoder's self-attention (every key visible) is possible; False
      for a causal-only recurrence, which validation keeps out of encoder stacks.
    supports_segments: packed segments (data.packing='segments') stay apart; False where only
      padding (segment 0) is hidden.
    scannable: the layers can be built by one trace for a scanned stack (model.scan_layers);
      False where each layer draws its own random pattern or features from a per-layer seed.
    cached_decoding: which KV-cache step `decode` is: 'dense' (this class's, every cached slot
      visible under causality and the window), 'own' (the variant overrides `decode` with its own
      pattern or state), or None (no cached decoding: eval.py's translation and tools.aot's decode
      program are refused at validation).
    has_paged_cache: `decode` reads a paged KV cache (`init_paged_cache`).
    gates_output, norms_qk: every output of the layer goes through `output` (model.attention_gate)
      and its q/k through `project` (model.qk_norm); a variant that computes either its own way
      sets the one it does not apply to False, and validation refuses that option for it.
    layer_terms: the `contract.ScoreTerms` fields the layer sets itself from its options
      (`LAYER_TERMS`: the logit soft cap, the sinks) that this variant applies; () where it
      computes attention its own way without them (validation refuses the options there).
    takes_layer, head_multiple: `from_config` takes `layer=`, the block's index in its stack
      (depth-dependent variants); `num_heads` and `num_kv_heads` must be multiples of it.
    options: the `config.model` fields `from_config` reads beyond the sizes.
  """

  has_scores = True
  takes_score_terms = True
  uses_kernel = True
  supports_causal = True
  supports_bidirectional = True
  supports_segments = True
  scannable = True
  cached_decoding = 'dense'
  has_paged_cache = True
  gates_output = True
  norms_qk = True
  layer_terms = ('softcap', 'sinks')
  takes_layer, head_multiple = False, 1
  options = ('use_bias', 'attention_impl', 'unscaled', 'attention_gate', 'qk_norm',
             'attn_logit_softcap', 'attention_sinks', 'attention_out_bias', 'norm_eps')
  dropout_rate = 0.0  # attention dropout (set by __init__); a variant built otherwise has none
  cache_form = '2·K·H'  # `cache_per_token` in words (tools.accounting's cache rows)
  param_form = None  # `param_count` in words where it is not the q/k/v/o projections' (MLA's)
  param_form_extra = ''  # what the variant adds to the projections' count, in words (Linformer's)

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, head_dim=None, use_bias=False,
               implementation='xla', local_window_size=None, scale=None, kernel_init=None,
               dropout_rate=0.0, gate='none', qk_norm='none', softcap=0.0, sinks=False, rngs,
               qk_norm_eps=attention_heads.EPSILON, out_bias=True):
    """Args:
      d_model: D, the input and output width.
      num_heads, num_kv_heads: N query heads, K key/value heads (None: K = N).
      head_dim: H (None: D / N); q/k/v project D -> N·H (K·H) and the output N·H -> D, so
        N·H need not equal D (the Flax examples' `qkv_dim`).
      use_bias: biases in the four projections (the output's only with `out_bias`).
      implementation: the kernel, a key of `IMPLEMENTATIONS`.
      local_window_size: see `dot_product_attention`.
      scale: the score scale (None: 1/sqrt(H)).
      kernel_init: the projections' initialiser (None: lecun_normal).
      dropout_rate: attention dropout on the probabilities while training (`__call__`'s rngs).
      gate, qk_norm: see `layers.attention_heads` (GATES, QK_NORMS).
      softcap: c > 0 caps every logit at c·tanh(s / c) (0: off); see `dot_product_attention`.
      sinks: a learned sink logit per query head, `sink_logits` `[N]`, initialised to 0 (an empty
        key's weight: at init a row's sink takes 1 / (1 + sum_j exp(s_ij)) of the mass).
      rngs: parameter initialisation.
      qk_norm_eps: QK-norm's epsilon (model.norm_eps).
      out_bias: with `use_bias`, the output projection has a bias too (False: q/k/v only, Qwen2).
    """
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = d_model // num_heads if head_dim is None else head_dim
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.implementation = implementation
    self.local_window_size = local_window_size
    self.scale = scale
    self.dropout_rate = dropout_rate
    self.softcap = float(softcap)
    self.sink_logits = (nnx.Param(jnp.zeros((num_heads,), jnp.float32), logical_axes=('heads',))
                        if sinks else None)
    init = nnx.initializers.lecun_normal() if kernel_init is None else kernel_init
    zeros = nnx.initializers.zeros

    def proj(d_in, d_out, names, bias=use_bias, **kwargs):  # kernel, bias: logical axis names
      return nnx.LinearGeneral(d_in, d_out, use_bias=bias, rngs=rngs, **kwargs,
                               kernel_init=sharding.partitioned(init, *names),
                               bias_init=sharding.partitioned(zeros, *names[-len(
                                   (d_out,) if isinstance(d_out, int) else d_out):]))

    self.query = proj(d_model, (num_heads, head_dim), ('embed', 'heads', 'head_dim'))
    self.key = proj(d_model, (num_kv_heads, head_dim), ('embed', 'kv_heads', 'head_dim'))
    self.value = proj(d_model, (num_kv_heads, head_dim), ('embed', 'kv_heads', 'head_dim'))
    self.out = proj((num_heads, head_dim), d_model, ('heads', 'head_dim', 'embed'),
                    bias=use_bias and out_bias, axis=(-2, -1))
    self.output_gate, self.qk_norm = attention_heads.make(
        gate, qk_norm, d_model, num_heads, head_dim, use_bias=use_bias, kernel_init=init, rngs=rngs,
        eps=qk_norm_eps)

  @classmethod
  def from_config(cls, cfg, *, rngs, **extra):
    """From `config.model`: sizes, head_dim, attention_bias (or use_bias), attention_impl, unscaled
    (scale 1 instead of 1/sqrt(H)), kernel_init, attention_dropout, the gate, QK-norm, soft cap
    and sinks; `extra`: a subclass's own constructor arguments."""
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, head_dim=initializers.head_dim(cfg),
               use_bias=initializers.attention_bias(cfg), implementation=cfg.attention_impl,
               scale=1.0 if cfg.get('unscaled', False) else None,
               kernel_init=initializers.kernel_init(cfg),
               dropout_rate=cfg.get('attention_dropout', 0.0),
               softcap=cfg.get('attn_logit_softcap', 0.0),
               sinks=cfg.get('attention_sinks', False), rngs=rngs,
               **attention_heads.layer_options(cfg), **extra)

  @classmethod
  def param_count(cls, cfg):
    """The parameters one layer of this variant holds, in closed form, from a resolved
    `config.model` (models.accounting sums them and tests them against the built model). A
    variant with parameters of its own extends this."""
    bias, head_dim = initializers.attention_bias(cfg), initializers.head_dim(cfg)
    on = 'sinks' in cls.layer_terms and cfg.get('attention_sinks', False)
    sinks = cfg.num_heads if on else 0  # a logit per head
    return (projection_params(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, use_bias=bias,
                              head_dim=head_dim, out_bias=cfg.get('attention_out_bias', True))
            + sinks
            + attention_heads.param_count(cfg, cfg.d_model, cfg.num_heads, head_dim, use_bias=bias))

  @classmethod
  def cache_per_token(cls, cfg):
    """Elements one layer's self-attention cache holds per token, in closed form from a resolved
    `config.model`: 2·K·H (a key and a value per key/value head); a variant caching something
    else (MLA's latent) overrides this, and `cache_form`, its closed form in words, with it.
    models.accounting's KV-cache rows read both."""
    return 2 * cfg.num_kv_heads * initializers.head_dim(cfg)

  @classmethod
  def check_options(cls, model_cfg):
    """`model.head_dim` (0 or a positive integer), `model.attention_bias` (a bool),
    `model.attention_dropout` (a rate in [0, 1)), `model.attention_gate`, `model.qk_norm`,
    `model.attn_logit_softcap` (a number >= 0), `model.attention_sinks` and
    `model.attention_out_bias` (bools)."""
    m = model_cfg
    attention_heads.check_options(m)
    head_dim = m.get('head_dim', 0)
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 0:
      raise options.ConfigError(f'model.head_dim={head_dim!r} must be an integer >= 0 (0 = '
                                'model.d_model / model.num_heads)')
    options.boolean('model.attention_bias', m.get('attention_bias', False))
    rate = m.get('attention_dropout', 0.0)
    options.positive('model.attention_dropout', rate, zero_ok=True)
    if rate >= 1:
      raise options.ConfigError(f'model.attention_dropout={rate!r} must be in [0, 1)')
    cap = m.get('attn_logit_softcap', 0.0)
    if (not isinstance(cap, (int, float)) or isinstance(cap, bool) or not math.isfinite(cap)
        or cap < 0):
      raise options.ConfigError(f'model.attn_logit_softcap={cap!r} must be a finite number >= 0 '
                                '(0 = off)')
    options.boolean('model.attention_sinks', m.get('attention_sinks', False))
    options.boolean('model.attention_out_bias', m.get('attention_out_bias', True))

  @classmethod
  def check_heads(cls, model_cfg):
    """Refuses `model.attention_gate` and `model.qk_norm` where the variant declares it does not
    apply them (`gates_output`, `norms_qk`)."""
    m = model_cfg
    for name, declared, default in (('attention_gate', cls.gates_output, 'none'),
                                    ('qk_norm', cls.norms_qk, 'none')):
      if not declared and m.get(name, default) != default:
        raise options.ConfigError(f'model.{name}={m[name]!r} is not applied by model.attention='
                                  f'{m.attention!r}; valid value here: {default!r}')

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """`model.unscaled` and the projection options a variant's own `from_config` would ignore.

    Variants extend this (calling it first) with their own options. What the variant, its kernel
    and the position method can take together is derived from their declarations by
    training/validation.py.
    """
    del data_cfg
    m = model_cfg
    options.boolean('model.unscaled', m.unscaled)
    cls.check_heads(m)
    if cls.from_config.__func__ is not Attention.from_config.__func__:
      # A variant building itself through its own from_config (sparse, linear) does not pass the
      # projection options on: refuse them rather than ignore them.
      defaults = {'head_dim': 0, 'attention_bias': False, 'attention_dropout': 0.0,
                  'kernel_init': 'lecun_normal'}
      for name in PROJECTION_OPTIONS:
        if m.get(name, defaults[name]) != defaults[name]:
          raise options.ConfigError(
              f'model.{name}={m[name]!r} is read by model.attention=\'dense\' only, not '
              f'{m.attention!r}; valid value here: {defaults[name]!r}')

  def positions_without_scores(self, q, k, positions, position, is_causal):
    """q, k after `position`'s rotation (RoPE); a method that adds score terms is a ValueError:
    for the variants whose kernels have no [T, S] scores to add them to (validation refuses the
    pair first, from `takes_score_terms` and the method's `terms_for`)."""
    if position is None:
      return q, k
    q, k, terms = position.in_attention(q, k, positions, positions, is_causal=is_causal)
    if terms:
      raise ValueError(f'attention={getattr(self, "name", type(self).__name__)!r} does not take '
                       f'score terms {list(terms.names())}; use rope, sinusoidal, learned or nope')
    return q, k

  def normalise(self, logits, vis):
    """`[B, N, T, S]` weights of the scaled scores `logits` at the visible keys `vis`
    (`attention_xla.scores`): softmax, a row with no visible key zeros. A variant with another
    normalisation (sigmoid) overrides this and declares `uses_kernel` False, since the kernels
    fuse the softmax; `attend` and `weights` then use it."""
    return attention_xla.probabilities(logits, vis)

  def score_scale(self, head_dim):
    """The score scale: `scale`, or 1/sqrt(H)."""
    return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

  def with_layer_terms(self, terms):
    """`terms` with the layer's own soft cap and sinks added, where set."""
    own = {'softcap': self.softcap or None,
           'sinks': None if self.sink_logits is None else self.sink_logits[...]}  # [N]
    own = {name: value for name, value in own.items() if value is not None}
    return dataclasses.replace(terms, **own) if own else terms

  def normalised(self, logits, vis, sinks=None):
    """`normalise` with the `[N]` sinks as one more key of no value (attention_xla.with_sink)."""
    if sinks is None:
      return self.normalise(logits, vis)
    return self.normalise(*attention_xla.with_sink(logits, vis, sinks))[..., :-1]  # [B, N, T, S]

  def prepare(self, x, context=None, *, positions=None, context_positions=None, position=None,
              is_causal=False):
    """The preamble `__call__`, `score_stats` and `weights` share: q `[B, T, N, H]`, k and v
    `[B, S, K, H]` after the position's rotation, and the `contract.ScoreTerms` it adds.

    A variant that changes the projections overrides `project`; one that changes what positions
    do overrides this.
    """
    q, k, v = self.project(x, context)
    if context is None:
      context_positions = positions if context_positions is None else context_positions
    terms = contract.NONE
    if position is not None:
      q, k, terms = position.in_attention(q, k, positions, context_positions, is_causal=is_causal)
    return q, k, v, self.with_layer_terms(terms)

  def project(self, x, context=None):
    """q `[B, T, N, H]`, k and v `[B, S, K, H]`."""
    context = x if context is None else context
    names = ('batch', 'length', 'heads', 'head_dim')
    kv_names = ('batch', 'length', 'kv_heads', 'head_dim')
    q, k = self.norm_qk(sharding.constrain(self.query(x), names),
                        sharding.constrain(self.key(context), kv_names))
    return q, k, sharding.constrain(self.value(context), kv_names)

  def norm_qk(self, q, k):
    """QK-norm (model.qk_norm) of projected q `[B, T, N, H]` and k `[B, S, K, H]` (either may be
    None), before a position method rotates them; unchanged without it."""
    return (q, k) if self.qk_norm is None else self.qk_norm(q, k)

  def output(self, y, x):
    """The layer's `[B, T, D]` output from the heads' `y` `[B, T, N, H]`: the output gate of `x`
    `[B, T, D]`, the queries' input (model.attention_gate), then the output projection. Every
    variant's forward and cached steps end here."""
    return self.out(y if self.output_gate is None else self.output_gate(y, x))

  def score_stats(self, x, *, segment_ids=None, positions=None, is_causal=False, position=None):
    """The training diagnostics' softmax statistics of this layer's self-attention on `x`.

    Only for layers with `has_scores`; the scores are those `__call__` computes with the same
    arguments (attention_xla.scores: scaled q·k plus the ALiBi/T5 terms, the window, causality
    and segments applied).

    Args:
      x: `[B, T, D]` the self-attention's input (after the block's norm under Pre-LN).
      segment_ids: `[B, T]` or None; queries with id 0 are padding and are not averaged.
      positions: `[B, T]` token positions, for `position`.
      is_causal: decoder self-attention.
      position: None or a `layers.positions` object acting inside attention.

    Returns:
      {'attn_max_logit': scalar, 'attn_entropy': scalar (nats), 'attn_sink_share': scalar}, see
      `attention_xla.score_statistics`.
    """
    if not self.has_scores:
      raise NotImplementedError(f'{type(self).__name__} has no [T, S] score matrix (has_scores '
                                'is False): its diagnostics are the activation RMS only')
    q, k, _, terms = self.prepare(x, positions=positions, position=position,
                                  is_causal=is_causal)  # [B, T, N, H], [B, T, K, H]
    logits, vis = attention_xla.scores(
        q, k, scale=self.score_scale(q.shape[-1]), is_causal=is_causal,
        window=masks.normalize_window(self.local_window_size), q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids, **terms.logit_kwargs())  # [B, N, T, S], the keys' only
    real = (jnp.ones(x.shape[:2], jnp.float32) if segment_ids is None
            else (segment_ids > 0).astype(jnp.float32))  # [B, T]
    return attention_xla.score_statistics(logits, vis, real)

  def __call__(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
               is_causal=False, positions=None, context_positions=None, position=None, rngs=None):
    """Args:
      x: `[B, T, D]` queries' input.
      context: None (self-attention) or `[B, S, D]` (cross-attention).
      segment_ids: `[B, T]` ids of x's tokens (0 for padding is fine: padding sees padding only).
      context_segment_ids: `[B, S]`; defaults to `segment_ids` for self-attention.
      is_causal: decoder self-attention.
      positions, context_positions: `[B, T]` / `[B, S]` token positions, for `position`.
      position: None or a `layers.positions` object acting inside attention.
      rngs: `nnx.Rngs` with a `dropout` stream for attention dropout while training (None:
        deterministic, no dropout).

    Returns:
      `[B, T, D]`.
    """
    q, k, v, terms = self.prepare(x, context, positions=positions,
                                  context_positions=context_positions, position=position,
                                  is_causal=is_causal)
    if context is None:
      context_segment_ids = segment_ids if context_segment_ids is None else context_segment_ids
    seg = None
    if segment_ids is not None:
      seg = (segment_ids, context_segment_ids)
    dropout_rng = rngs.dropout() if rngs is not None and self.dropout_rate > 0 else None
    out = self.attend(q, k, v, terms, segment_ids=seg, is_causal=is_causal,
                      window=self.local_window_size, implementation=self.implementation,
                      dropout_rng=dropout_rng)  # [B, T, N, H]
    return self.output(out, x)  # [B, T, D]

  def attend(self, q, k, v, terms, *, segment_ids=None, is_causal=False, window=None,
             implementation='xla', dropout_rng=None):
    """The attention of prepared q `[B, T, N, H]`, k, v `[B, S, K, H]` with `terms`: softmax
    through the kernel `implementation`, or, for a variant that declares `uses_kernel` False,
    its own `normalise` of the materialised scores. `__call__` and the cached step both end here.

    Args:
      segment_ids: None or (`[B, T]`, `[B, S]`) segment ids of queries and keys.
      is_causal, window: see `dot_product_attention` (`local_window_size`).
      dropout_rng: None (no dropout) or the key of this call's attention dropout.

    Returns:
      `[B, T, N, H]`.
    """
    rate = self.dropout_rate if dropout_rng is not None else 0.0
    if not self.uses_kernel:
      # The variant's own normalisation of the materialised [B, N, T, S] scores.
      logits, vis = attention_xla.scores(
          q, k, scale=self.score_scale(q.shape[-1]), is_causal=is_causal,
          window=masks.normalize_window(window),
          q_segment_ids=None if segment_ids is None else segment_ids[0],
          kv_segment_ids=None if segment_ids is None else segment_ids[1],
          **terms.logit_kwargs())
      probs = self.normalised(logits, vis, terms.sinks)  # [B, N, T, S]
      if rate > 0:
        probs = attention_xla.drop(probs, rate, attention_xla.dropout_seed(dropout_rng))
      return attention_xla.combine(probs, v).astype(q.dtype)  # [B, T, N, H]
    return dot_product_attention(q, k, v, segment_ids=segment_ids, is_causal=is_causal,
                                 scale=self.scale, local_window_size=window,
                                 implementation=implementation, dropout_rate=rate,
                                 dropout_rng=dropout_rng, **terms.kwargs())

  def weights(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
              is_causal=False, positions=None, context_positions=None, position=None):
    """The `[B, N, T, S]` attention probabilities of `__call__` with the same arguments (plots)."""
    q, k, _, terms = self.prepare(x, context, positions=positions,
                                  context_positions=context_positions, position=position,
                                  is_causal=is_causal)
    if context is None:
      context_segment_ids = segment_ids if context_segment_ids is None else context_segment_ids
    logits, vis = attention_xla.scores(
        q.astype(jnp.float32), k.astype(jnp.float32), scale=self.score_scale(q.shape[-1]),
        is_causal=is_causal, window=masks.normalize_window(self.local_window_size),
        q_segment_ids=segment_ids, kv_segment_ids=context_segment_ids, **terms.logit_kwargs())
    return self.normalised(logits, vis, terms.sinks)  # [B, N, T, S]
