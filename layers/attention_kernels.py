"""The exact-softmax kernels: the `dot_product_attention` contract and the table of what each
takes."""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from layers import attention_blockwise
from layers import attention_pallas
from layers import attention_pallas_gpu
from layers import attention_pallas_tpu
from layers import attention_ring
from layers import attention_sharded
from layers import attention_splash
from layers import attention_xla
from layers import contract
from layers import masks
from layers import options


def _cudnn(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
           alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None):
  """jax's fused cuDNN kernel (GPU only), the production reference for the flash kernels."""
  if alibi_slopes is not None:
    t, s = query.shape[1], key.shape[1]
    alibi = masks.alibi_bias(alibi_slopes, jnp.arange(t)[:, None], jnp.arange(s)[None])[None]
    bias = alibi if bias is None else bias + alibi
  return jax.nn.dot_product_attention(
      query, key, value, bias=None if bias is None else bias.astype(query.dtype), mask=mask,
      scale=scale, is_causal=is_causal, local_window_size=window,
      query_seq_lengths=None, key_value_seq_lengths=None, implementation='cudnn')


# Exact softmax attention kernels, keyed by `config.model.attention_impl`, and what each takes
# (layers.contract.Kernel): validation derives every kernel rule from this one table. The flash
# kernels (blockwise, ring, Pallas) take the soft cap and the sinks in layers.flash_core.
KERNELS = {
    'xla': contract.Kernel(attention_xla.attention, dropout=True, decodes=True, value_width=True),
    'blockwise': contract.Kernel(attention_blockwise.attention, dropout=True, score_matmuls=7),
    # Custom calls XLA cannot partition: per device under shard_map on a mesh (attention_sharded),
    # each device holding the whole sequence. They take dense arrays, not a bias function.
    'pallas': contract.Kernel(attention_sharded.per_device(attention_pallas.attention),
                              terms=('bias', 'alibi_slopes', 'mask', 'softcap', 'sinks'),
                              sequence_mesh='never', score_matmuls=9, tiles=(
                                  ('tpu', (attention_pallas_tpu.DEFAULT_BLOCK_Q,
                                           attention_pallas_tpu.DEFAULT_BLOCK_K)),
                                  ('cuda', (attention_pallas_gpu.DEFAULT_BLOCK_Q,
                                            attention_pallas_gpu.DEFAULT_BLOCK_K)))),
    # jax's TPU splash kernel: block-sparse over its static causal/window mask (the tiles it skips
    # are pallas's on TPU), the soft cap and the sinks in the kernel, GQA in its MHA form. Mosaic
    # only: refused off TPU, and compiled for a TPU target by tools.aot (`compiling_for`).
    'splash': contract.Kernel(attention_sharded.per_device(attention_splash.attention),
                              terms=('softcap', 'sinks'), sequence_mesh='never',
                              platforms=('tpu',), score_matmuls=9, tiles=(
                                  ('tpu', (attention_splash.BLOCK, attention_splash.BLOCK)),)),
    # jax.nn's fused call has no soft cap and no sink.
    'cudnn': contract.Kernel(attention_sharded.per_device(_cudnn),
                             terms=('bias', 'alibi_slopes', 'mask'), sequence_mesh='never',
                             platforms=('gpu',), score_matmuls=7),
    # The length split over mesh.sequence: only terms computed from the positions on each device
    # (and the per-head ones).
    # On one device (evaluation) the same exact attention is xla's.
    'ring': contract.Kernel(attention_ring.ring_attention,
                            terms=('alibi_slopes', 'softcap', 'sinks'), sequence_mesh='needed',
                            single_device='xla', score_matmuls=7),
}
# The kernel of `implementation=None` and of the variants that run none (validation offers it as
# the only value there): it takes every term and dropout, decodes, and runs on every platform.
DEFAULT = 'xla'


# The backend the programs traced now are lowered for, where not this host's (`compiling_for`).
_TARGET = contextvars.ContextVar('attention_target_platform', default=None)


def target_platform():
  """The jax backend ('cpu', 'gpu', 'tpu') the kernels are checked against: the one
  `compiling_for` names, else this host's."""
  return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform):
  """Within it, configs are validated and programs traced for `platform` (a compile-only device's
  `.platform`, e.g. 'tpu' when a CPU host compiles for a pod): a kernel is checked against the
  target's backend, not this host's."""
  token = _TARGET.set(platform)
  try:
    yield
  finally:
    _TARGET.reset(token)


def kernels_taking(term=None, *, dropout=False):
  """The names of the kernels that take ScoreTerms field `term` (and dropout, if asked)."""
  return sorted(name for name, k in KERNELS.items()
          if (term is None or term in k.terms) and (k.dropout or not dropout))


def check_kernel_call(impl, terms, dropout):
  """Raises ValueError unless kernel `impl` takes the ScoreTerms fields `terms` (and dropout) and
  runs on this backend: the same declarations validation reads, for direct callers."""
  kernel = options.lookup('implementation', KERNELS, impl)
  missing = kernel.missing(terms)
  if missing:
    raise ValueError(f'implementation={impl!r} cannot take {contract.TERM_NAMES[missing[0]]}; '
                     f'valid: {", ".join(kernels_taking(missing[0]))}')
  if dropout and not kernel.dropout:
    raise ValueError('attention dropout is implemented by '
                     f'{", ".join(kernels_taking(dropout=True))}'
                     f', not {impl!r}')
  if target_platform() not in kernel.platforms:
    raise ValueError(f'implementation={impl!r} runs on {", ".join(kernel.platforms)}, not '
                     f'{target_platform()}')


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          local_window_size=None, alibi_slopes=None, segment_ids=None,
                          implementation=None, position_bias=None, dropout_rate=0.0,
                          dropout_rng=None, softcap=None, sinks=None):
  """Scaled dot-product attention, mirroring `jax.nn.dot_product_attention`.

  Args:
    query: `[B, T, N, H]`.
    key, value: `[B, S, K, H]` with N a multiple of K (K = N: MHA, K = 1: MQA, between: GQA).
    bias: optional, broadcastable to `[B, N, T, S]`, added to the scaled scores.
    mask: optional boolean, broadcastable to `[B, N, T, S]`, True where a key may be attended.
    scale: score scale; None means 1/sqrt(H), which keeps Var(q·k) at 1 for unit-variance inputs.
    is_causal: key j is visible from query i only if j <= i.
    local_window_size: int w (|i - j| <= w) or (left, right), as in jax.nn.
    alibi_slopes: optional `[N]`; adds -slope * |i - j| to head n's scores.
    segment_ids: `[B, T]` (self-attention) or a pair (`[B, T]`, `[B, S]`); attention stays within
      equal ids (packed sequences; give padding its own id).
    implementation: None (= 'xla') or a key of `KERNELS`.
    position_bias: optional `layers.relative_bias.PositionBias` (FIRE, KERPLE), a learned bias of
      the positions; only the xla and blockwise kernels evaluate it.
    dropout_rate: attention dropout on the probabilities (xla and blockwise only; 0 = none).
    dropout_rng: a jax key, needed when `dropout_rate` > 0; xla and blockwise drop the same
      probabilities for the same key (attention_xla.dropout_keep).
    softcap: None/0 or c > 0: the logits (scaled q·k plus the added terms) become c·tanh(s / c)
      before the mask (Gemma 2).
    sinks: None or `[N]` learned logits that join each row's softmax denominator only, with no
      value (GPT-OSS): a row with no visible key is zeros, and the rows sum to less than 1.

  Returns:
    `[B, T, N, H]`; a query row with no visible key is zeros.
  """
  impl = DEFAULT if implementation is None else implementation
  softcap = softcap or None  # 0 is off
  given = dict(bias=bias, mask=mask, alibi_slopes=alibi_slopes, position_bias=position_bias,
               softcap=softcap, sinks=sinks)
  check_kernel_call(impl, [n for n in contract.TERMS if given[n] is not None], dropout_rate > 0)
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError('query, key, value must be [B, T, N, H], [B, S, K, H], [B, S, K, H]')
  if key.shape != value.shape[:3] + key.shape[3:] or key.shape[2] != value.shape[2]:
    raise ValueError(f'key {key.shape} and value {value.shape} disagree on [B, S, K]')
  n, k = query.shape[2], key.shape[2]
  if n % k:
    raise ValueError(f'query heads ({n}) must be a multiple of key/value heads ({k})')
  if sinks is not None and sinks.shape != (n,):
    raise ValueError(f'sinks {sinks.shape} must be one logit per query head, ({n},)')
  if scale is None:
    scale = 1.0 / math.sqrt(query.shape[-1])
  extra = {name: given[name] for name in ('position_bias', 'softcap', 'sinks')
           if given[name] is not None}
  if dropout_rate > 0:
    extra.update(dropout_rate=float(dropout_rate),
                 dropout_seed=attention_xla.dropout_seed(dropout_rng))
  q_seg = kv_seg = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      q_seg, kv_seg = segment_ids
    else:
      q_seg = kv_seg = segment_ids
  return KERNELS[impl].fn(
      query, key, value, bias, mask, scale=scale, is_causal=is_causal,
      window=masks.normalize_window(local_window_size), alibi_slopes=alibi_slopes,
      q_segment_ids=q_seg, kv_segment_ids=kv_seg, **extra)
