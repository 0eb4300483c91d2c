"""Low-rank and kernelised attention (Linformer, Performer, linear): O(T·k) or O(T·m) memory.

`linear` (Katharopoulos et al. 2020) and `performer` (FAVOR+, Choromanski et al. 2021) replace
softmax(q·k) by a feature map phi(q)·phi(k), so that sum_j phi(k_j) v_j^T is formed once
(bidirectional) or as a prefix sum (causal) and no T×S matrix exists. `linformer` (Wang et al. 2020)
projects the T keys and values to k rows with learned E, F and runs softmax attention over those.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import attention as attention_lib
from layers import attention_heads
from layers import attention_xla
from layers import options

# Causal linear attention runs in chunks: inside a chunk the c×c masked form, across chunks the
# prefix sum of phi(k)^T v carried per chunk. Memory is (T/c)·M·H + T·c per head: linear in T.
DEFAULT_CHUNK = 128


def elu_plus_one(x):
  """phi(x) = elu(x) + 1 > 0 (Katharopoulos et al.)."""
  return jax.nn.elu(x) + 1.0


def orthogonal_features(key, num_features, dim):
  """`[M, H]` FAVOR+ directions: blocks of H orthogonal Gaussian rows, each rescaled to a chi(H)
  norm.

  Orthogonal rows keep each feature's marginal (so the estimator stays unbiased) and lower its
  variance relative to i.i.d. Gaussian rows.
  """
  num_blocks = -(-num_features // dim)
  k_dirs, k_norms = jax.random.split(key)
  gauss = jax.random.normal(k_dirs, (num_blocks, dim, dim), jnp.float32)
  q = jnp.linalg.qr(gauss)[0]  # [nb, H, H], one batched QR; columns orthonormal
  w = jnp.swapaxes(q, 1, 2).reshape(num_blocks * dim, dim)[:num_features]  # [M, H] unit rows
  norms = jnp.linalg.norm(jax.random.normal(k_norms, (num_features, dim), jnp.float32), axis=1)
  return w * norms[:, None]


def orthogonal_features_np(seed, num_features, dim):
  """`orthogonal_features` drawn with NumPy from an int seed: a trace-time constant (XLA's QR
  expansion is slow to compile on CPU, and fixed features need no program of their own)."""
  rng = np.random.default_rng(seed)
  num_blocks = -(-num_features // dim)
  q = np.linalg.qr(rng.standard_normal((num_blocks, dim, dim)))[0]  # [nb, H, H]
  w = np.swapaxes(q, 1, 2).reshape(num_blocks * dim, dim)[:num_features]  # [M, H] unit rows
  norms = np.linalg.norm(rng.standard_normal((num_features, dim)), axis=1)
  return (w * norms[:, None]).astype(np.float32)


def favor_features(x, w, *, stabilise_axes):
  """Positive random features: E[phi(q)·phi(k)] = exp(q·k) (up to one constant factor).

  phi(x) = exp(w·x - |x|²/2 - c) / sqrt(M). The shift c (the max of w·x - |x|²/2 over
  `stabilise_axes`, held constant for the gradient) only keeps exp in range: a query's c cancels in
  its normalisation, and one c shared by all keys cancels between numerator and denominator. The
  |x|²/2 term is inside the max: with it outside, a query or key of large norm had every feature
  underflow towards 0, and the normaliser's gradient (1/den²) overflowed to NaN in training (the
  encoder-decoder of the attention-variants study, from about step 150).

  Args:
    x: `[..., H]` queries or keys, already scaled by scale**0.5.
    w: `[M, H]` from `orthogonal_features`.
    stabilise_axes: axes of the `[..., M]` projection the shift is a max over.

  Returns:
    `[..., M]` float32.
  """
  proj = jnp.einsum('...H,MH->...M', x.astype(jnp.float32), w)  # [..., M]
  sq = 0.5 * jnp.sum(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)  # [..., 1]
  logits = proj - sq
  shift = jax.lax.stop_gradient(jnp.max(logits, axis=stabilise_axes, keepdims=True))
  return jnp.exp(logits - shift) / math.sqrt(w.shape[0])


def performer_features(q, k, w, scale):
  """FAVOR+ features of q `[B, T, K, G, H]` and k `[B, S, K, H]` approximating exp(scale·q·k)."""
  # exp(q·k·scale) = exp((q·sqrt(scale))·(k·sqrt(scale))): split the scale between the two sides.
  r = math.sqrt(scale)
  qf = favor_features(q * r, w, stabilise_axes=(-1,))  # one shift per query row
  kf = favor_features(k * r, w, stabilise_axes=(1, 3))  # one shift per (batch, kv head)
  return qf, kf


# A denominator at or below this counts as zero: the query sees no key (padding), or (Performer,
# causal) every key it sees lies so far below the row's shared stabilising shift that its features
# (nearly) underflowed. The quotient's gradient holds den^-2, which overflows float32 below about
# 1e-19 (a key logit gap of about 45): such a denominator turned it NaN in training (2 of 3
# Performer
# seeds of the attention-variants study, after the stabiliser fix).
MIN_DENOMINATOR = 1e-15


def _safe_divide(num, den):
  # Such queries give zeros and a zero gradient, never NaN.
  ok = den > MIN_DENOMINATOR
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def kernel_attention(qf, kf, v, *, is_causal=False, chunk=DEFAULT_CHUNK):
  """sum_j phi(q_i)·phi(k_j) v_j / sum_j phi(q_i)·phi(k_j), without a T×S matrix.

  Args:
    qf: `[B, T, K, G, M]` non-negative query features.
    kf: `[B, S, K, M]` non-negative key features (zero rows: hidden keys, e.g. padding).
    v: `[B, S, K, H]`.
    is_causal: j <= i (needs S = T), by chunked prefix sums.
    chunk: chunk length of the causal form.

  Returns:
    `[B, T, K, G, H]` float32.
  """
  v = v.astype(jnp.float32)
  if not is_causal:
    kv = jnp.einsum('BSKM,BSKH->BKMH', kf, v)  # [B, K, M, H]: formed once, O(M·H) not O(T·S)
    z = jnp.sum(kf, axis=1)  # [B, K, M]
    num = jnp.einsum('BTKGM,BKMH->BTKGH', qf, kv)
    den = jnp.einsum('BTKGM,BKM->BTKG', qf, z)
    return _safe_divide(num, den[..., None])
  b, t, kh, g, m = qf.shape
  if kf.shape[1] != t:
    raise ValueError(f'causal linear attention needs S = T, got S={kf.shape[1]}, T={t}')
  c = min(chunk, t)
  nc = -(-t // c)
  pad = nc * c - t
  # Zero-padded keys add nothing to the sums; padded query rows are dropped at the end.
  qc = jnp.pad(qf, [(0, 0), (0, pad)] + [(0, 0)] * 3).reshape(b, nc, c, kh, g, m)
  kc = jnp.pad(kf, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(b, nc, c, kh, m)
  vc = jnp.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)]).reshape(b, nc, c, kh, -1)
  kv = jnp.einsum('BCSKM,BCSKH->BCKMH', kc, vc)  # [B, C, K, M, H] per chunk
  z = jnp.sum(kc, axis=2)  # [B, C, K, M]
  # State before each chunk: the exclusive prefix sum over earlier chunks.
  kv_prev = jnp.concatenate([jnp.zeros_like(kv[:, :1]), jnp.cumsum(kv, 1)[:, :-1]], 1)
  z_prev = jnp.concatenate([jnp.zeros_like(z[:, :1]), jnp.cumsum(z, 1)[:, :-1]], 1)
  num = jnp.einsum('BCTKGM,BCKMH->BCTKGH', qc, kv_prev)  # [B, C, c, K, G, H]
  den = jnp.einsum('BCTKGM,BCKM->BCTKG', qc, z_prev)  # [B, C, c, K, G]
  a = jnp.einsum('BCTKGM,BCSKM->BCKGTS', qc, kc) * jnp.tril(jnp.ones((c, c), jnp.float32))
  num = num + jnp.einsum('BCKGTS,BCSKH->BCTKGH', a, vc)
  den = den + jnp.sum(a, -1).transpose(0, 1, 4, 2, 3)  # [B, C, c, K, G]
  out = _safe_divide(num, den[..., None])
  return out.reshape(b, nc * c, kh, g, -1)[:, :t]


def kernel_weights(qf, kf, *, is_causal=False):
  """The implied `[B, N, T, S]` attention of `kernel_attention`: the quadratic reference
  (tests, plots)."""
  b, t, kh, g, m = qf.shape
  a = jnp.einsum('BTKGM,BSKM->BKGTS', qf, kf)  # [B, K, G, T, S]
  if is_causal:
    a = a * jnp.tril(jnp.ones((t, kf.shape[1]), jnp.float32))
  return _safe_divide(a, jnp.sum(a, -1, keepdims=True)).reshape(b, kh * g, t, -1)


class _Kernel(attention_lib.Attention):
  """Shared call path of `linear` and `performer`: features of q and k, then `kernel_attention`."""

  name = 'kernel'
  chunk = DEFAULT_CHUNK
  # No softmax over [T, S] scores (the diagnostics report the activation RMS only), nothing to add
  # a score term to, padding hidden but not packed segments (see `_features`), and a recurrent
  # `decode` of its own.
  has_scores = False
  takes_score_terms = False
  uses_kernel = False  # its own attention computation: model.attention_impl does not apply
  layer_terms = ()  # no logit soft cap, no sinks in its own computation
  supports_segments = False
  cached_decoding = 'own'  # `decode` below: running sums of the key features
  has_paged_cache = False

  cache_form = '0 (a state of fixed size)'

  @classmethod
  def cache_per_token(cls, cfg):
    """0: the cached state is running sums of a fixed size (`init_cache`), nothing per token."""
    del cfg
    return 0

  def features(self, q, k):
    """(`[B, T, K, G, M]`, `[B, S, K, M]`) non-negative features of q `[B, T, N, H]`,
    k `[B, S, K, H]`."""
    raise NotImplementedError

  def _features(self, x, context, segment_ids, context_segment_ids, positions, position,
                is_causal):
    q, k, v = self.project(x, context)
    if context is None:
      context_segment_ids = segment_ids if context_segment_ids is None else context_segment_ids
    q, k = self.positions_without_scores(q, k, positions, position, is_causal)
    b, t, n, h = q.shape
    kh = k.shape[2]
    qf, kf = self.features(q.reshape(b, t, kh, n // kh, h), k)
    if context_segment_ids is not None:
      # Padding keys (segment 0) are hidden by zeroing their features. Packed segments are not
      # supported (training/validation.py rejects data.packing='segments' for these variants).
      kf = kf * (context_segment_ids > 0)[:, :, None, None].astype(kf.dtype)
    return qf, kf, v

  def __call__(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
               is_causal=False, positions=None, context_positions=None, position=None):
    """As `Attention.__call__`."""
    qf, kf, v = self._features(x, context, segment_ids, context_segment_ids, positions, position,
                               is_causal)
    out = kernel_attention(qf, kf, v, is_causal=is_causal, chunk=self.chunk)  # [B, T, K, G, H]
    b, t = out.shape[:2]
    return self.output(out.reshape(b, t, -1, out.shape[-1]).astype(x.dtype), x)

  def weights(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
              is_causal=False, positions=None, context_positions=None, position=None):
    """The `[B, N, T, S]` implied attention (quadratic: for plots and tests only)."""
    qf, kf, _ = self._features(x, context, segment_ids, context_segment_ids, positions, position,
                               is_causal)
    return kernel_weights(qf, kf, is_causal=is_causal)

  # --- Recurrent decoding: the causal prefix sums are the cache (constant size in the length) -----

  feature_dim = None  # M, set by the variants

  def decode_key_features(self, k):
    """(`[B, 1, K, M]` features of one new key divided by exp(shift), the `[B, 1, K]` shift)."""
    raise NotImplementedError

  def init_cache(self, batch_size, max_length, dtype=jnp.float32):
    """The causal state: {'kv': sum_j phi(k_j) v_j^T `[B, K, M, H]`, 'z': sum_j phi(k_j)
    `[B, K, M]`, 'shift': `[B, K]`, the log-scale both sums are stored at}. Its size does not grow
    with `max_length` (float32 whatever `dtype`: these are running sums)."""
    del max_length, dtype
    k, m, h = self.num_kv_heads, self.feature_dim, self.head_dim
    return {'kv': jnp.zeros((batch_size, k, m, h), jnp.float32),
            'z': jnp.zeros((batch_size, k, m), jnp.float32),
            'shift': jnp.full((batch_size, k), -1e30, jnp.float32)}

  def decode(self, x, cache, index, *, position=None):
    """One causal step: the new token's key joins the prefix sums, its query reads them.

    Steps must come in order, one position per call (as models.decoding feeds them): the state
    holds every key fed so far. Returns (`[B, 1, D]`, the updated state).
    """
    b = x.shape[0]
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))
    q, k, v = self.project(x)  # [B, 1, N, H], [B, 1, K, H], [B, 1, K, H]
    q, k = self.positions_without_scores(q, k, index[:, None], position, True)
    kh, h = k.shape[2], q.shape[-1]
    qf, _ = self.features(q.reshape(b, 1, kh, -1, h), k)  # [B, 1, K, G, M]
    kf, key_shift = self.decode_key_features(k)  # [B, 1, K, M], [B, 1, K]
    # Sums are kept at scale exp(-shift): a larger new shift rescales the old sums (as in online
    # softmax); the ratio num/den is unchanged by any common scale.
    shift = jnp.maximum(cache['shift'], key_shift[:, 0])  # [B, K]
    old, new = jnp.exp(cache['shift'] - shift), jnp.exp(key_shift[:, 0] - shift)  # [B, K]
    kf = kf[:, 0] * new[..., None]  # [B, K, M]
    kv = cache['kv'] * old[..., None, None] + jnp.einsum('BKM,BKH->BKMH', kf,
                                                          v[:, 0].astype(jnp.float32))
    z = cache['z'] * old[..., None] + kf
    num = jnp.einsum('BKGM,BKMH->BKGH', qf[:, 0], kv)
    den = jnp.einsum('BKGM,BKM->BKG', qf[:, 0], z)
    out = _safe_divide(num, den[..., None]).reshape(b, 1, -1, h)  # [B, 1, N, H]
    return self.output(out.astype(x.dtype), x), {'kv': kv, 'z': z, 'shift': shift}


def _common(cfg):
  return dict(use_bias=cfg.use_bias, implementation=cfg.attention_impl,
              scale=1.0 if cfg.get('unscaled', False) else None,
              **attention_heads.layer_options(cfg))


class LinearAttention(_Kernel):
  """Linear attention with phi = elu + 1 (Katharopoulos et al. 2020)."""

  name = 'linear'

  @classmethod
  def from_config(cls, cfg, *, rngs):
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, rngs=rngs, **_common(cfg))

  @property
  def feature_dim(self):
    return self.head_dim

  def features(self, q, k):
    return elu_plus_one(q.astype(jnp.float32)), elu_plus_one(k.astype(jnp.float32))

  def decode_key_features(self, k):
    return elu_plus_one(k.astype(jnp.float32)), jnp.zeros(k.shape[:3], jnp.float32)


class RandomFeatures(nnx.Variable):
  """A non-trainable random projection (the Performer's `[M, H]` feature directions).

  Model state outside the optimiser: train.py keeps it beside the parameters, checkpoints it, and
  replaces it when `model.performer_redraw` says so; evaluation and decoding use what was saved.
  """


def feature_draw(seed, draw, num_features, dim):
  """The `[M, H]` directions of draw number `draw` of a layer seeded `seed` (NumPy, host-side)."""
  return orthogonal_features_np([seed, draw] if draw else seed, num_features, dim)


class PerformerAttention(_Kernel):
  """Performer (FAVOR+): positive orthogonal random features approximating softmax attention.

  The directions live in `self.features_w` (a `RandomFeatures` variable), drawn at construction
  from `seed` (configs give each layer its own). With `redraw_every` = R > 0 the training loop calls
  `redraw(step // R)` every R steps (`redraw_features` in train.py): draw d is a function of (seed,
  d) only, so a resumed run redraws exactly as an uninterrupted one; R = 0 keeps the first draw.
  """

  name = 'performer'
  # Each layer draws its features from its own `attention_seed` (models/stack.py gives every layer
  # one), which one trace shared by scanned layers cannot do.
  scannable = False
  options = attention_lib.Attention.options + ('performer_features', 'performer_redraw',
                                               'attention_seed')

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, num_features=64, redraw_every=0,
               seed=0, **kwargs):
    super().__init__(d_model, num_heads, num_kv_heads, **kwargs)
    self.num_features, self.redraw_every, self.seed = (int(num_features), int(redraw_every),
                                                       int(seed))
    self.features_w = RandomFeatures(jnp.asarray(
        feature_draw(self.seed, 0, self.num_features, self.head_dim)))

  @classmethod
  def from_config(cls, cfg, *, rngs):
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, num_features=cfg.performer_features,
               redraw_every=cfg.performer_redraw, seed=cfg.attention_seed, rngs=rngs,
               **_common(cfg))

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    super().check_config(model_cfg, data_cfg)
    m = model_cfg
    if not isinstance(m.performer_features, int) or m.performer_features <= 0:
      raise options.ConfigError(f'model.performer_features={m.performer_features!r} must be a '
                                'positive integer')
    if not isinstance(m.performer_redraw, int) or m.performer_redraw < 0:
      raise options.ConfigError(f'model.performer_redraw={m.performer_redraw!r} must be an integer '
                                '>= 0 (0 = fixed features, R = redraw every R training steps)')

  def redraw(self, draw):
    """Replaces the directions by draw number `draw` (host-side, outside jit)."""
    self.features_w.value = jnp.asarray(
        feature_draw(self.seed, int(draw), self.num_features, self.head_dim))

  def features(self, q, k):
    scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    w = jax.lax.stop_gradient(self.features_w.value.astype(jnp.float32))
    return performer_features(q, k, w, scale)

  @property
  def feature_dim(self):
    return self.num_features

  def decode_key_features(self, k):
    scale = self.scale if self.scale is not None else 1.0 / math.sqrt(k.shape[-1])
    w = self.features_w.value.astype(jnp.float32)
    kf = favor_features(k * math.sqrt(scale), w, stabilise_axes=(-1,))  # one shift per key
    x = k.astype(jnp.float32) * math.sqrt(scale)
    logits = (jnp.einsum('...H,MH->...M', x, w)
              - 0.5 * jnp.sum(jnp.square(x), -1, keepdims=True))  # as in favor_features
    shift = jnp.max(logits, axis=-1)  # that shift, [B, 1, K]
    return kf, shift


class LinformerAttention(attention_lib.Attention):
  """Linformer (Wang et al. 2020): keys and values projected along the sequence to k rows by learned
  `E`, `F` `[k, max_length]` (shared by the heads), then softmax attention over those k rows.

  Not causal: each projected row mixes every position, future ones included.
  """

  name = 'linformer'
  # Softmax over the k projected rows, not over [T, S] scores; each row mixes every position (no
  # causal form) and only padding is hidden; no cached step.
  has_scores = False
  takes_score_terms = False
  uses_kernel = False  # its own attention computation: model.attention_impl does not apply
  layer_terms = ()  # no logit soft cap, no sinks in its own computation
  supports_causal = False
  supports_segments = False
  cached_decoding = None  # its projection mixes every position: no causal form to cache
  has_paged_cache = False
  options = attention_lib.Attention.options + ('linformer_k', 'linformer_length')
  param_form_extra = ' + 2·k·T (E, F)'

  @classmethod
  def param_count(cls, cfg):
    """The projections and E, F `[k, max_length]`, shared by the heads."""
    return super().param_count(cfg) + 2 * cfg.linformer_k * cfg.linformer_length

  def __init__(self, d_model, num_heads, num_kv_heads=None, *, k=32, max_length, rngs, **kwargs):
    super().__init__(d_model, num_heads, num_kv_heads, rngs=rngs, **kwargs)
    self.max_length = int(max_length)
    init = nnx.initializers.normal(stddev=1.0 / math.sqrt(max_length))
    self.proj_k = nnx.Param(init(rngs.params(), (k, max_length), jnp.float32))  # E
    self.proj_v = nnx.Param(init(rngs.params(), (k, max_length), jnp.float32))  # F

  @classmethod
  def resolve_options(cls, model_cfg, data_cfg):
    """model.linformer_length 0 is data.max_length, the longest input."""
    if model_cfg.get('linformer_length', None) == 0:
      model_cfg.linformer_length = data_cfg.max_length

  @classmethod
  def from_config(cls, cfg, *, rngs):
    if not cfg.get('linformer_length', 0):
      raise ValueError('model.linformer_length is 0: run training.validation.resolve first')
    return cls(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, k=cfg.linformer_k,
               max_length=cfg.linformer_length, rngs=rngs, **_common(cfg))

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    super().check_config(model_cfg, data_cfg)
    m, length = model_cfg, data_cfg.max_length
    if not isinstance(m.linformer_k, int) or m.linformer_k <= 0:
      raise options.ConfigError(f'model.linformer_k={m.linformer_k!r} must be a positive integer')
    if not isinstance(m.linformer_length, int) or m.linformer_length < length:
      raise options.ConfigError(f'model.linformer_length={m.linformer_length!r} must be >= '
                                f'data.max_length={length} (0 = data.max_length)')

  def _project_kv(self, x, context, segment_ids, context_segment_ids, positions, position,
                  is_causal):
    if is_causal:
      raise ValueError("attention='linformer' is not causal (its projections mix future keys)")
    q, k, v = self.project(x, context)
    if context is None:
      context_segment_ids = segment_ids if context_segment_ids is None else context_segment_ids
    q, k = self.positions_without_scores(q, k, positions, position, is_causal)
    s = k.shape[1]
    if s > self.max_length:
      raise ValueError(f'linformer was built for at most {self.max_length} keys, got {s}')
    if context_segment_ids is not None:
      real = (context_segment_ids > 0)[:, :, None, None].astype(k.dtype)  # padding adds nothing
      k, v = k * real, v * real
    e, f = self.proj_k[:, :s], self.proj_v[:, :s]  # [k, S]
    kp = jnp.einsum('RS,BSKH->BRKH', e.astype(k.dtype), k)  # [B, k, K, H]
    vp = jnp.einsum('RS,BSKH->BRKH', f.astype(v.dtype), v)  # [B, k, K, H]
    return q, kp, vp

  def __call__(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
               is_causal=False, positions=None, context_positions=None, position=None):
    """As `Attention.__call__` (bidirectional only)."""
    q, kp, vp = self._project_kv(x, context, segment_ids, context_segment_ids, positions,
                                 position, is_causal)
    out = attention_lib.dot_product_attention(q, kp, vp, scale=self.scale,
                                              implementation='xla')  # [B, T, N, H], O(T·k)
    return self.output(out, x)

  def weights(self, x, context=None, *, segment_ids=None, context_segment_ids=None,
              is_causal=False, positions=None, context_positions=None, position=None):
    """`[B, N, T, k]` probabilities over the k projected rows."""
    q, kp, _ = self._project_kv(x, context, segment_ids, context_segment_ids, positions, position,
                                is_causal)
    scale = self.scale if self.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return attention_xla.attention_weights(q, kp, scale=scale)

  def decode(self, x, cache, index, *, position=None):
    del x, cache, index, position  # validation refuses decoding first (cached_decoding is None)
    raise NotImplementedError("KV-cache decoding is not possible for attention='linformer'")
