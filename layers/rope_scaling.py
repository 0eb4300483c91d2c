"""RoPE's context scalings (PI, NTK, YaRN, Llama 3, dynamic NTK): the inverse frequencies."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

# Context-window scalings, keyed by `config.model.rope_scaling` (and eval.py's `--rope_scaling`).
SCALINGS = ('none', 'pi', 'ntk', 'yarn', 'llama3', 'dynamic')

# YaRN's ramp bounds (Peng et al. 2023, sec. 3.2: alpha = 1, beta = 32 rotations over the original
# context), named as in transformers' `_compute_yarn_parameters` (beta_slow, beta_fast): the
# defaults of `model.rope_yarn_beta_slow` and `model.rope_yarn_beta_fast`.
YARN_BETA_SLOW = 1.0
YARN_BETA_FAST = 32.0


@dataclasses.dataclass(frozen=True)
class ScalingParams:
  """The knobs of the scalings beyond the factor (frozen: static in NNX's graph definition).

  Attributes:
    original_length: L, the pretrained context the yarn, llama3 and dynamic scalings refer to
      (None: unknown, refused by those three).
    low_freq_factor, high_freq_factor: llama3's wavelength bounds L / low and L / high.
    beta_fast, beta_slow: YaRN's ramp bounds, in rotations over L.
    attention_factor: YaRN's q/k temperature; 0 = the paper's 0.1·ln(s) + 1.
  """

  original_length: int = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = YARN_BETA_FAST
  beta_slow: float = YARN_BETA_SLOW
  attention_factor: float = 0.0

  @classmethod
  def from_config(cls, cfg, max_length):
    """From `config.model`'s rope_* fields; `rope_original_length` 0 is `max_length`."""
    return cls(original_length=cfg.get('rope_original_length', 0) or max_length,
               low_freq_factor=float(cfg.get('rope_low_freq_factor', 1.0)),
               high_freq_factor=float(cfg.get('rope_high_freq_factor', 4.0)),
               beta_fast=float(cfg.get('rope_yarn_beta_fast', YARN_BETA_FAST)),
               beta_slow=float(cfg.get('rope_yarn_beta_slow', YARN_BETA_SLOW)),
               attention_factor=float(cfg.get('rope_attention_factor', 0.0)))


def _yarn_correction_dim(num_rotations, dim, base, original_max_length):
  """The frequency index i whose wavelength 2*pi*base^(2i/d) fits `num_rotations` times into L."""
  return dim * math.log(original_max_length / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(inv_freq, d, base, factor, params):
  """"NTK-by-parts" as in transformers' `_compute_yarn_parameters` (modeling_rope_utils.py,
  truncate=True) and the paper's reference code (jquesnelle/yarn): frequencies that turn fewer
  than beta_slow times over L are interpolated (theta / s), those turning more than beta_fast
  times are kept (extrapolated), and between them a ramp blends the two. The ramp is linear in
  the index i between the rounded bounds (the code's rule; eq. 18 writes it linear in r)."""
  length = params.original_length
  low = math.floor(_yarn_correction_dim(params.beta_fast, d, base, length))
  high = math.ceil(_yarn_correction_dim(params.beta_slow, d, base, length))
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001  # as transformers: avoid a zero-width ramp
  ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # [d/2]
  extrapolate = 1.0 - ramp  # 1 for high frequencies (i < low), 0 for low ones (i > high)
  return inv_freq / factor * (1.0 - extrapolate) + inv_freq * extrapolate


def _llama3(inv_freq, factor, params):
  """Llama 3.1's rule (transformers' `_compute_llama3_parameters`): wavelengths longer than
  L / low_freq_factor are interpolated (theta / s), those shorter than L / high_freq_factor kept,
  and between them blended by how many times they fit into L."""
  length, low, high = params.original_length, params.low_freq_factor, params.high_freq_factor
  wavelen = 2 * math.pi / inv_freq  # [d/2]
  scaled = np.where(wavelen > length / low, inv_freq / factor, inv_freq)
  smooth = (length / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < length / high) & ~(wavelen > length / low)
  return np.where(medium, smoothed, scaled)


def rope_inv_freq(head_dim_rotary, base=10000.0, scaling='none', factor=1.0,
                  original_max_length=None, *, params=None):
  """Inverse frequencies theta_i = base^(-2i/d), i < d/2, after a context scaling.

  Args:
    head_dim_rotary: d, the rotated dimensions (even).
    base: RoPE base (10000 in Su et al.).
    scaling: 'none' | 'pi' (Chen et al. 2023: positions x 1/factor, i.e. theta_i / factor) |
      'ntk' (bloc97's NTK-aware rule: base x factor^(d/(d-2)), so the lowest frequency is
      interpolated by `factor` and the highest is kept) | 'yarn' (Peng et al. 2023, `_yarn`) |
      'llama3' (`_llama3`) | 'dynamic' (NTK by the call's length, `dynamic_inv_freq`: here the
      frequencies of a call no longer than L, which are the unscaled ones).
    factor: s = L_eval / L_train (1.0 = no scaling).
    original_max_length: L, the training context (yarn and llama3); overrides `params`'.
    params: a `ScalingParams` (None: the defaults).

  Returns:
    float64 numpy array `[d/2]`.
  """
  params = params or ScalingParams()
  if original_max_length is not None:
    params = dataclasses.replace(params, original_length=original_max_length)
  d = head_dim_rotary
  if d < 2 or d % 2:
    raise ValueError(f'rotary dimensions must be even and >= 2, got {d}')
  if scaling not in SCALINGS:
    raise ValueError(f'rope_scaling {scaling!r} unknown; valid: {list(SCALINGS)}')
  if factor <= 0:
    raise ValueError(f'rope_scaling_factor must be positive, got {factor}')
  if scaling in ('yarn', 'llama3', 'dynamic') and params.original_length is None:
    raise ValueError(f'rope_scaling={scaling!r} needs the original training length')
  if scaling == 'ntk':
    base = base * factor ** (d / (d - 2))
  inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
  if scaling == 'pi':
    return inv_freq / factor
  if scaling == 'yarn':
    return _yarn(inv_freq, d, base, factor, params)
  if scaling == 'llama3':
    return _llama3(inv_freq, factor, params)
  return inv_freq


def dynamic_inv_freq(head_dim_rotary, base, factor, original_length, positions):
  """Dynamic NTK (transformers' `_compute_dynamic_ntk_parameters` under `dynamic_rope_update`):
  the base grows with the call's length, base·((s·n / L) - (s - 1))^(d/(d-2)) with
  n = max(largest position + 1, L), so a call within L is unscaled.

  The length is the largest of `positions` over the whole batch, traced, as transformers takes
  torch.max(position_ids): a cached step at position p gets n = p + 1, and the cache holds keys
  rotated when they were computed, which is what transformers' generation does too.

  Args:
    head_dim_rotary: d (even).
    base, factor: RoPE's base and s.
    original_length: L.
    positions: int array of any shape (every position of this call).

  Returns:
    float32 `[d/2]`.
  """
  d = head_dim_rotary
  seq_len = jnp.maximum(jnp.max(positions).astype(jnp.float32) + 1.0, float(original_length))
  scaled = base * ((factor * seq_len / original_length) - (factor - 1.0)) ** (d / (d - 2))
  return scaled ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)  # [d/2]


def attention_factor(scaling, factor, params=None):
  """YaRN's temperature: q and k are each multiplied by 0.1 ln(s) + 1 (1 for other scalings), or
  by `params.attention_factor` when it is set (> 0).

  Peng et al. 2023 eq. 22 write softmax(q.k / (t sqrt(d))) with sqrt(1/t) = 0.1 ln(s) + 1, so the
  logits are scaled by (0.1 ln s + 1)^2, i.e. q and k by 0.1 ln s + 1 each; transformers'
  `_compute_yarn_parameters` returns that `attention_factor` and multiplies cos and sin by it.
  """
  if scaling != 'yarn':
    return 1.0
  if params is not None and params.attention_factor > 0:
    return float(params.attention_factor)
  if factor <= 1.0:
    return 1.0
  return 0.1 * math.log(factor) + 1.0
