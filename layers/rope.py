"""Rotary position embedding (RoPE, Su et al. 2021) and xPos, under a context scaling."""

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import contract
from layers import options
from layers import rope_scaling

# Re-exported: the scalings and their frequencies live in rope_scaling.
SCALINGS = rope_scaling.SCALINGS
YARN_BETA_SLOW = rope_scaling.YARN_BETA_SLOW
YARN_BETA_FAST = rope_scaling.YARN_BETA_FAST
ScalingParams = rope_scaling.ScalingParams
rope_inv_freq = rope_scaling.rope_inv_freq
attention_factor = rope_scaling.attention_factor


def rotary_dims(head_dim, fraction):
  """Rotated dimensions of a head: `fraction` of H rounded down to an even number (pairs rotate)."""
  return 2 * int(head_dim * fraction // 2)


def apply_rope(x, positions, inv_freq, scale=1.0):
  """Rotates the first 2*len(inv_freq) dimensions of each head by position * theta_i.

  Pairs are (x_i, x_{i + d/2}) ("rotate half", as GPT-NeoX, gemma and transformers); the remaining
  dimensions (partial rotary) pass through.

  Args:
    x: `[B, T, N, H]`.
    positions: `[B, T]` (or `[1, T]`) int positions, absolute within each sequence.
    inv_freq: `[d/2]` float32 inverse frequencies.
    scale: multiplies the whole result (YaRN's temperature; 1.0 otherwise).

  Returns:
    `[B, T, N, H]` in x's dtype.
  """
  d = 2 * inv_freq.shape[0]
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, d/2]
  cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, d/2]
  sin = jnp.sin(angles)[:, :, None, :]  # [B, T, 1, d/2]
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :d // 2], xf[..., d // 2:d]  # [B, T, N, d/2] each
  rest = xf[..., d:]  # [B, T, N, H - d], not rotated
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)  # [B, T, N, H]
  if scale != 1.0:
    # On every dimension, so that the logits get the paper's temperature even with partial rotary
    # (transformers scales only the rotated dimensions; identical when the fraction is 1).
    out = out * scale
  return out.astype(x.dtype)


class RoPE(nnx.Module, options.Configurable, contract.PositionDeclarations):
  """Rotates q and k by their positions: <R(i) q, R(j) k> depends on j - i only.

  The scaling is plain Python attributes (static in NNX's graph definition, not parameters), so
  `layers.positions.with_rope_scaling` can change it on a built or restored model at evaluation.
  The position method 'rope' of `layers.positions.POSITIONS` (the interface of its `Position`).
  """

  rotates = True  # it rotates q and k; the scores get no term
  rotates_any_width = True  # `rotate` below (layers.contract.PositionDeclarations)
  random_ids = True  # absolute ids: model.random_positions_max applies
  exclusive_options = {'rope_scaling': ('none', 'scales RoPE')}
  eval_options = ('rope_scaling', 'rope_scaling_factor')  # eval.py's --rope_scaling
  options = ('rope_base', 'rope_fraction', 'rope_scaling', 'rope_scaling_factor',
             'rope_original_length', 'rope_low_freq_factor', 'rope_high_freq_factor',
             'rope_yarn_beta_fast', 'rope_yarn_beta_slow', 'rope_attention_factor')

  def __init__(self, head_dim, *, fraction=1.0, base=10000.0, scaling='none', factor=1.0,
               original_max_length=None, params=None):
    """Args:
      head_dim: H.
      fraction: part of H that is rotated (1.0 = all; the rest carries no position).
      base: RoPE base.
      scaling, factor: see `rope_inv_freq`.
      original_max_length: L, the context yarn, llama3 and dynamic refer to (the training length,
        or `model.rope_original_length`); overrides `params`' when given.
      params: a `ScalingParams` (llama3's and YaRN's knobs; None: the defaults).
    """
    self.head_dim = head_dim
    self.rotary_dims = rotary_dims(head_dim, fraction)
    self.base = float(base)
    params = params or ScalingParams()
    if original_max_length is not None:
      params = dataclasses.replace(params, original_length=original_max_length)
    self.params = params
    self.original_max_length = params.original_length
    self.set_scaling(scaling, factor)

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    """From `config.model` (d_model, num_heads, rope_*); `max_length` is YaRN's original context."""
    del rngs
    head_dim = cfg.get('head_dim', 0) or cfg.d_model // cfg.num_heads  # model.head_dim, 0 = D / N
    return cls(head_dim, fraction=cfg.rope_fraction, base=cfg.rope_base,
               scaling=cfg.rope_scaling, factor=cfg.rope_scaling_factor,
               params=ScalingParams.from_config(cfg, max_length))

  def set_eval_options(self, model_cfg):
    """The scaling of `config.model` (eval.py's --rope_scaling), on the built method."""
    self.set_scaling(model_cfg.rope_scaling, model_cfg.rope_scaling_factor)

  @classmethod
  def check_options(cls, model_cfg):
    """The rope_* fields, checked whatever the position (every config carries them)."""
    m = model_cfg
    options.positive('model.rope_base', m.rope_base)
    if m.rope_base <= 1:
      raise options.ConfigError(f'model.rope_base={m.rope_base!r} must be > 1')
    if not isinstance(m.rope_fraction, (int, float)) or not 0.0 < m.rope_fraction <= 1.0:
      raise options.ConfigError(f'model.rope_fraction={m.rope_fraction!r} must be in (0, 1]')
    options.choice('model.rope_scaling', m.rope_scaling, SCALINGS)
    options.positive('model.rope_scaling_factor', m.rope_scaling_factor)
    if m.rope_scaling != 'none' and m.rope_scaling_factor < 1:
      raise options.ConfigError(f'model.rope_scaling_factor={m.rope_scaling_factor!r} must be >= '
                                '1 (it is L_eval / L_train)')
    cls.check_scaling_params(m)

  @classmethod
  def check_scaling_params(cls, model_cfg):
    """`model.rope_original_length` (an integer >= 0), the llama3 and YaRN knobs."""
    m = model_cfg
    length = m.get('rope_original_length', 0)
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
      raise options.ConfigError(f'model.rope_original_length={length!r} must be an integer >= 0 '
                                '(0 = data.max_length)')
    for name in ('rope_low_freq_factor', 'rope_high_freq_factor', 'rope_yarn_beta_fast',
                 'rope_yarn_beta_slow'):
      options.positive(f'model.{name}', m.get(name, 1.0))
    options.positive('model.rope_attention_factor', m.get('rope_attention_factor', 0.0),
                     zero_ok=True)
    low, high = m.get('rope_low_freq_factor', 1.0), m.get('rope_high_freq_factor', 4.0)
    if high <= low:
      raise options.ConfigError(f'model.rope_high_freq_factor={high!r} must be > '
                                f'model.rope_low_freq_factor={low!r}')
    fast, slow = m.get('rope_yarn_beta_fast', 32.0), m.get('rope_yarn_beta_slow', 1.0)
    if fast <= slow:
      raise options.ConfigError(f'model.rope_yarn_beta_fast={fast!r} must be > '
                                f'model.rope_yarn_beta_slow={slow!r}')

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """At least one pair of each head's dimensions is rotated."""
    del data_cfg
    m = model_cfg
    head_dim = m.get('head_dim', 0) or m.d_model // m.num_heads  # model.head_dim, 0 = D / N
    if rotary_dims(head_dim, m.rope_fraction) < 2:
      raise options.ConfigError(f'model.rope_fraction={m.rope_fraction!r} rotates no pair of the '
                                f'{head_dim} head dimensions; raise it')

  def set_scaling(self, scaling, factor):
    """Sets the context scaling (a key of `SCALINGS`) and its factor."""
    rope_inv_freq(self.rotary_dims, self.base, scaling, factor, params=self.params)  # checks
    self.scaling, self.factor = scaling, float(factor)

  def inv_freq(self):
    """`[d/2]` float64 numpy inverse frequencies under the current scaling (under 'dynamic',
    those of a call within L: `frequencies` gives a call's own)."""
    return rope_inv_freq(self.rotary_dims, self.base, self.scaling, self.factor,
                         params=self.params)

  def frequencies(self, width, *positions):
    """`[width/2]` float32 inverse frequencies for a call at `positions` (int arrays): static,
    except under 'dynamic' (with s > 1), whose base follows the call's largest position."""
    if self.scaling == 'dynamic' and self.factor > 1.0:
      every = jnp.concatenate([jnp.ravel(p) for p in positions])  # all of this call's positions
      return rope_scaling.dynamic_inv_freq(width, self.base, self.factor,
                                           self.params.original_length, every)
    return jnp.asarray(rope_inv_freq(width, self.base, self.scaling, self.factor,
                                     params=self.params), jnp.float32)

  def embed(self, x, positions):
    del positions
    return x

  def check_length(self, length):
    del length

  def rotate(self, x, positions):
    """x `[B, T, N, d]` rotated over all its d dimensions (any even d, not only this method's
    head width) with this method's base and scaling: a variant's own rotary part (MLA's decoupled
    query and key, DeepSeek-V2 eqs. 14 and 16).

    Args:
      x: `[B, T, N, d]`, d even.
      positions: `[B|1, T]` int positions, or None for 0..T-1.
    """
    if positions is None:
      positions = jnp.arange(x.shape[1])[None]  # [1, T]
    inv_freq = self.frequencies(x.shape[-1], positions)  # [d/2]
    return apply_rope(x, positions, inv_freq,
                      attention_factor(self.scaling, self.factor, self.params))

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    del is_causal
    if q_pos is None:
      q_pos = jnp.arange(q.shape[1])[None]  # [1, T]
    if k_pos is None:
      k_pos = jnp.arange(k.shape[1])[None]  # [1, S]
    inv_freq = self.frequencies(self.rotary_dims, q_pos, k_pos)  # [d/2]
    scale = attention_factor(self.scaling, self.factor, self.params)
    return (apply_rope(q, q_pos, inv_freq, scale), apply_rope(k, k_pos, inv_freq, scale),
            contract.NONE)


# xPos's constants (Sun et al. 2022; torchscale's XPOS): zeta_i = (i / (d/2) + 0.4) / 1.4.
XPOS_GAMMA = 0.4


def xpos_zeta(rotary_dims):
  """`[d/2]` float64 per-pair decay bases zeta_i = (2i + 0.4 d) / (1.4 d), in (0, 1)."""
  d = rotary_dims
  return (np.arange(0, d, 2, dtype=np.float64) + XPOS_GAMMA * d) / ((1.0 + XPOS_GAMMA) * d)


def apply_xpos_scale(x, positions, zeta, scale_base, centre, sign):
  """Scales pair i of the rotated dims by zeta_i^(sign * (p - centre) / scale_base).

  With sign +1 for queries at n and -1 for keys at m, q.k gains zeta^((n - m) / scale_base): a
  decay in the distance only. The centre cancels; it keeps the exponents small, so that neither
  factor overflows float32 at long positions (torchscale centres positions the same way).

  Args:
    x: `[B, T, N, H]` (already rotated); positions `[B|1, T]` int; zeta `[d/2]` float32.

  Returns:
    `[B, T, N, H]` in x's dtype.
  """
  d = 2 * zeta.shape[0]
  power = sign * (positions.astype(jnp.float32) - centre) / scale_base  # [B, T]
  factor = jnp.exp(power[..., None] * jnp.log(zeta))[:, :, None, :]  # [B, T, 1, d/2]
  xf = x.astype(jnp.float32)
  out = jnp.concatenate([xf[..., :d // 2] * factor, xf[..., d // 2:d] * factor, xf[..., d:]], -1)
  return out.astype(x.dtype)


class XPos(RoPE):
  """xPos (Sun et al. 2022): RoPE with q scaled by zeta^(n/gamma) and k by zeta^(-m/gamma).

  The scores get zeta^((n - m)/gamma) on each pair, a decay with the distance n - m >= 0 in a causal
  decoder (the paper's form; in an encoder the factor grows for keys ahead of the query). Positions
  are centred on `centre` (half the training length), fixed per model, so a cached key keeps the
  factor the full forward gives it. The RoPE scalings (eval.py's --rope_scaling) change only the
  rotation frequencies.

  With `block` = w > 0, causal attention is the paper's blockwise causal attention (its sec. 3.3,
  used at inference): a query at n sees the keys of its own block of w positions and of the block
  before, m >= (n // w - 1) w. With w the training length, training is plain causal attention.
  """

  # Its decay belongs to the head width it was built for: no `rotate` of another width.
  rotates_any_width = False
  # Not offered with xPos: randomized ids and the RoPE scalings in training or at evaluation.
  random_ids = False
  exclusive_options = {}
  eval_options = ('xpos_block',)  # eval.py's --xpos_block
  options = RoPE.options + ('xpos_scale_base', 'xpos_block')

  def set_eval_options(self, model_cfg):
    """`config.model`'s blockwise causal block (eval.py's --xpos_block), on the built method."""
    self.block = int(model_cfg.get('xpos_block', 0))

  def __init__(self, head_dim, *, scale_base=512.0, centre=0, block=0, **kwargs):
    super().__init__(head_dim, **kwargs)
    self.scale_base = float(scale_base)
    self.centre = int(centre)
    self.block = int(block)

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    del rngs
    head_dim = cfg.get('head_dim', 0) or cfg.d_model // cfg.num_heads  # model.head_dim, 0 = D / N
    return cls(head_dim, scale_base=cfg.xpos_scale_base, block=cfg.get('xpos_block', 0),
               centre=max_length // 2, fraction=cfg.rope_fraction, base=cfg.rope_base,
               scaling=cfg.rope_scaling, factor=cfg.rope_scaling_factor,
               params=ScalingParams.from_config(cfg, max_length))

  @classmethod
  def check_options(cls, model_cfg):
    options.positive('model.xpos_scale_base', model_cfg.xpos_scale_base)
    block = model_cfg.get('xpos_block', 0)
    if not isinstance(block, int) or isinstance(block, bool) or block < 0:
      raise options.ConfigError(f'model.xpos_block={block!r} must be an integer >= 0 (0 = plain '
                                'causal attention; w = blockwise causal with blocks of w)')

  @classmethod
  def terms_for(cls, model_cfg):
    """A `[T, S]` mask with `model.xpos_block` > 0 (the blockwise causal form), else none."""
    return ('mask',) if model_cfg.get('xpos_block', 0) else ()

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    if q_pos is None:
      q_pos = jnp.arange(q.shape[1])[None]  # [1, T]
    if k_pos is None:
      k_pos = jnp.arange(k.shape[1])[None]  # [1, S]
    q, k, terms = super().in_attention(q, k, q_pos, k_pos, is_causal=is_causal)
    zeta = jnp.asarray(xpos_zeta(self.rotary_dims), jnp.float32)  # [d/2]
    if self.block and is_causal:
      terms = contract.ScoreTerms(mask=blockwise_causal_mask(q_pos, k_pos, self.block))
    return (apply_xpos_scale(q, q_pos, zeta, self.scale_base, self.centre, 1.0),
            apply_xpos_scale(k, k_pos, zeta, self.scale_base, self.centre, -1.0), terms)


def blockwise_causal_mask(q_pos, k_pos, block):
  """xPos's blockwise causal attention: True where key position m >= (n // w - 1) w for query n
  (its own block and the previous one; causality itself is the kernels' `is_causal`).

  Args:
    q_pos: `[B|1, T]` int; k_pos: `[B|1, S]` int; block: w.

  Returns:
    boolean `[B|1, 1, T, S]`.
  """
  first = (q_pos // block - 1) * block  # [B, T]: the first key position a query sees
  return (k_pos[:, None, :] >= first[:, :, None])[:, None]  # [B, 1, T, S]


def with_rope_scaling(model, scaling, factor):
  """Sets the RoPE context scaling of every RoPE object in a built NNX model, in place.

  No parameter changes, so it applies to a restored checkpoint (eval.py's `--rope_scaling`). The
  scaling lives in the graph definition: split the model (or re-split) after calling this.

  Args:
    model: an NNX module.
    scaling: a key of `SCALINGS`.
    factor: the scaling factor.

  Returns:
    `model`.

  Raises:
    ValueError: the model has no RoPE position, or the scaling is invalid.
  """
  found = [node for _, node in nnx.iter_graph(model) if isinstance(node, RoPE)]
  if not found:
    raise ValueError('with_rope_scaling: the model has no RoPE position (config.model.position '
                     "must be 'rope')")
  for node in found:
    node.set_scaling(scaling, factor)
  return model


def with_xpos_block(model, block):
  """Sets xPos's blockwise causal attention of a built NNX model, in place: blocks of `block`
  positions, or 0 for plain causal attention (eval.py's `--xpos_block`). No parameter changes;
  split the model (or re-split) after calling this.

  Raises:
    ValueError: the model has no xPos position, or `block` is negative.
  """
  found = [node for _, node in nnx.iter_graph(model) if isinstance(node, XPos)]
  if not found:
    raise ValueError("--xpos_block: the model has no xPos position (config.model.position must "
                     "be 'xpos')")
  if not isinstance(block, int) or block < 0:
    raise ValueError(f'--xpos_block={block!r} must be an integer >= 0 (0 = plain causal)')
  for node in found:
    node.block = block
  return model
