"""Position information, keyed by `config.model.position`.

A position object has two hooks: `embed(x, positions)` for absolute methods that add a vector to the
token embeddings, and `in_attention(q, k, q_pos, k_pos, is_causal=...)` for methods that act on the
scores (RoPE rotates q and k; ALiBi and T5 add a bias). Each method implements the one it needs.
One object is built per stack and shared by its layers (one T5 table per stack, as in T5).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import contract
from layers import options
from layers import relative_bias
from layers import rope

rope_inv_freq = rope.rope_inv_freq  # re-exported: the RoPE frequencies under a scaling
with_rope_scaling = rope.with_rope_scaling  # re-exported: a built model's RoPE scaling
with_xpos_block = rope.with_xpos_block  # re-exported: a built model's xPos block


class Position(nnx.Module, options.Configurable, contract.PositionDeclarations):
  """No position information (NoPE): self-attention is then permutation-equivariant.

  The base of the position methods registered in POSITIONS (rope.RoPE shares its declarations,
  `layers.contract.PositionDeclarations`, where they are described).
  """

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    """From `config.model` and the training length `max_length`."""
    del cfg, max_length, rngs
    return cls()

  def embed(self, x, positions):
    del positions
    return x

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    """q, k (rotated by methods that rotate) and the `contract.ScoreTerms` this method adds.

    Args:
      q: `[B, T, N, H]`; k: `[B, S, K, H]`.
      q_pos, k_pos: `[B|1, T]` / `[B|1, S]` int positions, or None for 0..T-1.
      is_causal: decoder self-attention.
    """
    del q_pos, k_pos, is_causal
    return q, k, contract.NONE

  def check_length(self, length):
    """Raises ValueError if sequences of `length` tokens cannot be represented."""
    del length


def sinusoid_table(positions, d_model, base=10000.0):
  """PE(p)[2i] = sin(p / base^(2i/D)), PE(p)[2i+1] = cos(p / base^(2i/D)) (Vaswani et al.).

  Args:
    positions: int array of any shape.
    d_model: D, even.

  Returns:
    float32 array `positions.shape + (D,)`.
  """
  inv_freq = base ** (-jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model)  # [D/2]
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., D/2]
  # Interleave sin and cos so each frequency's pair is a 2-D rotation:
  # PE(p + delta) = M(delta) PE(p).
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, d_model)


class Sinusoidal(Position):
  """Fixed sinusoidal positions added to the embeddings."""

  random_ids = True

  def __init__(self, d_model, max_length, *, rngs):
    del max_length, rngs
    self.d_model = d_model

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    return cls(cfg.d_model, max_length, rngs=rngs)

  def embed(self, x, positions):
    return x + sinusoid_table(positions, self.d_model).astype(x.dtype)  # [B, T, D]


class Learned(Position):
  """A learned table of `max_length` rows added to the embeddings; longer inputs are an error.

  The rows are `model.max_positions` when set (GPT-2's 1024, whatever the training length), else
  the training length (or `model.random_positions_max`, whose ids reach that far).
  """

  random_ids = True
  param_form = 'T_max·D per stack'
  exclusive_options = {'max_positions': (0, "sets the learned table's rows")}
  options = ('max_positions',)

  def __init__(self, d_model, max_length, *, rngs):
    self.max_length = max_length
    self.table = nnx.Embed(max_length, d_model, rngs=rngs,
                           embedding_init=nnx.initializers.normal(stddev=0.02))

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    return cls(cfg.d_model, cls.max_positions(cfg, max_length), rngs=rngs)

  @classmethod
  def max_positions(cls, model_cfg, max_length):
    """The table's rows: `model.max_positions`, or (0) the training length, and randomized
    positions (random_positions_max = N) train every row of an N-row table."""
    rows = model_cfg.get('max_positions', 0) or 0
    return rows or max(max_length, model_cfg.get('random_positions_max', 0) or 0)

  @classmethod
  def check_options(cls, model_cfg):
    """`model.max_positions` an integer >= 0."""
    rows = model_cfg.get('max_positions', 0)
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
      raise options.ConfigError(f'model.max_positions={rows!r} must be an integer >= 0 (0 = '
                                'data.max_length)')

  @classmethod
  def check_config(cls, model_cfg, data_cfg):
    """A set `model.max_positions` holds data.max_length and random_positions_max positions."""
    rows, need = model_cfg.get('max_positions', 0), data_cfg.max_length
    need = max(need, model_cfg.get('random_positions_max', 0) or 0)
    if rows and rows < need:
      raise options.ConfigError(f'model.max_positions={rows} must be 0 or >= {need} (data.'
                                'max_length, and model.random_positions_max when set)')

  @classmethod
  def param_count(cls, model_cfg, max_length):
    return cls.max_positions(model_cfg, max_length) * model_cfg.d_model

  def check_length(self, length):
    if length > self.max_length:
      raise ValueError(f'position=learned has a table of max_length={self.max_length} rows; '
                       f'cannot embed {length} positions (train longer or use another position)')

  def embed(self, x, positions):
    self.check_length(x.shape[1])
    return x + self.table(positions).astype(x.dtype)  # [B, T, D]


def alibi_slopes(num_heads):
  """ALiBi's per-head slopes (Press et al. 2022; `get_slopes` of the reference code).

  For h a power of two: 2^(-8/h), 2^(-16/h), ..., 2^(-8). Otherwise the slopes of the closest
  smaller power of two, then every other slope of the sequence for twice that many heads.

  Returns:
    float64 numpy array `[N]`.
  """
  def power_of_two(n):
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]

  if num_heads <= 0:
    raise ValueError(f'num_heads must be positive, got {num_heads}')
  if math.log2(num_heads).is_integer():
    return np.array(power_of_two(num_heads))
  closest = 2 ** math.floor(math.log2(num_heads))
  extra = alibi_slopes(2 * closest)[0::2][:num_heads - closest]
  return np.concatenate([power_of_two(closest), extra])


class ALiBi(Position):
  """A fixed per-head linear penalty -slope * |i - j| on the scores (no parameters).

  The kernels compute |i - j| from array indices, in place: right for every packing here (the
  positions of a row are 0..T-1, or restart per contiguous segment whose cross-segment scores are
  masked anyway). It is the paper's causal form in decoders and the symmetric form in encoders.
  """

  terms = ('alibi_slopes',)

  def __init__(self, num_heads):
    self.num_heads = num_heads

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    del max_length, rngs
    return cls(cfg.num_heads)

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    del q_pos, k_pos, is_causal
    return q, k, contract.ScoreTerms(
        alibi_slopes=jnp.asarray(alibi_slopes(self.num_heads), jnp.float32))


def t5_relative_position_bucket(relative_position, *, bidirectional, num_buckets=32,
                                max_distance=128):
  """T5's bucket of relative position j - i (transformers' `_relative_position_bucket`).

  Bidirectional: half the buckets for j > i, half for j <= i. Within a half, distances below
  half of its buckets get one bucket each; the rest are log-spaced up to `max_distance`, beyond
  which everything shares the last bucket. Unidirectional (causal): only j <= i, all buckets for it.

  Args:
    relative_position: int array, key position minus query position.
    bidirectional: encoders True, causal decoders False.
    num_buckets, max_distance: as in T5 (32, 128).

  Returns:
    int32 array of the same shape, in [0, num_buckets).
  """
  rel = jnp.asarray(relative_position, jnp.int32)
  buckets = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    buckets = buckets + (rel > 0).astype(jnp.int32) * num_buckets
    dist = jnp.abs(rel)
  else:
    dist = -jnp.minimum(rel, 0)
  max_exact = num_buckets // 2
  # Clamped to >= 1 before the log so that the (unused) small branch never computes log(0).
  large = max_exact + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / max_exact)
                       / math.log(max_distance / max_exact)
                       * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return buckets + jnp.where(dist < max_exact, dist, large)


class T5Bias(Position):
  """A learned scalar per (relative-position bucket, head) added to the scores (Raffel et al.)."""

  terms = ('bias',)
  options = ('t5_num_buckets', 't5_max_distance')
  param_form = 'buckets·N per stack'

  @classmethod
  def param_count(cls, model_cfg, max_length):
    del max_length
    return model_cfg.t5_num_buckets * model_cfg.num_heads

  def __init__(self, num_heads, d_model, *, num_buckets=32, max_distance=128, rngs):
    self.num_buckets, self.max_distance = num_buckets, max_distance
    # transformers' T5 init: normal with stddev d_model^-0.5.
    self.table = nnx.Embed(num_buckets, num_heads, rngs=rngs,
                           embedding_init=nnx.initializers.normal(stddev=d_model ** -0.5))

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    del max_length
    return cls(cfg.num_heads, cfg.d_model, num_buckets=cfg.t5_num_buckets,
               max_distance=cfg.t5_max_distance, rngs=rngs)

  @classmethod
  def check_options(cls, model_cfg):
    m = model_cfg
    if (not isinstance(m.t5_num_buckets, int) or m.t5_num_buckets < 4 or m.t5_num_buckets % 2):
      raise options.ConfigError(f'model.t5_num_buckets={m.t5_num_buckets!r} must be an even '
                                'integer >= 4')
    if not isinstance(m.t5_max_distance, int) or m.t5_max_distance <= m.t5_num_buckets // 2:
      raise options.ConfigError(f'model.t5_max_distance={m.t5_max_distance!r} must be an integer '
                                f'> model.t5_num_buckets // 2 = {m.t5_num_buckets // 2}')

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    if q_pos is None:
      q_pos = jnp.arange(q.shape[1])[None]  # [1, T]
    if k_pos is None:
      k_pos = jnp.arange(k.shape[1])[None]  # [1, S]
    rel = k_pos[:, None, :] - q_pos[:, :, None]  # [B, T, S]
    buckets = t5_relative_position_bucket(rel, bidirectional=not is_causal,
                                          num_buckets=self.num_buckets,
                                          max_distance=self.max_distance)  # [B, T, S]
    bias = self.table(buckets).transpose(0, 3, 1, 2)  # [B, N, T, S]
    return q, k, contract.ScoreTerms(bias=bias)


def random_positions(key, positions, max_position):
  """Randomized positions (Ruoss et al. 2023): each row's ids mapped to sorted draws from [0, N).

  Per row, T distinct values are drawn from [0, N) without replacement and sorted; position p of
  the row becomes the p-th smallest. Packed segments, whose positions restart at 0, keep their
  order within the segment; a row of 0..T-1 becomes the sorted draw itself.

  Args:
    key: a jax random key.
    positions: `[B, T]` int positions in [0, T).
    max_position: N >= T.

  Returns:
    `[B, T]` int32 positions, increasing where `positions` increase, in [0, N).
  """
  b, t = positions.shape
  # The T smallest of N uniform keys' indices: a uniform T-subset of [0, N), then sorted.
  order = jnp.argsort(jax.random.uniform(key, (b, max_position)), axis=-1)[:, :t]  # [B, T]
  table = jnp.sort(order, axis=-1).astype(jnp.int32)  # [B, T]
  return jnp.take_along_axis(table, positions.astype(jnp.int32), axis=1)  # [B, T]


class LearnedBias(Position):
  """A learned bias function of the positions (FIRE, KERPLE): `in_attention` returns it unevaluated
  as a `relative_bias.PositionBias` for the kernel to compute on its tiles (subclasses set `fn`)."""

  terms = ('position_bias',)
  name = None  # the POSITIONS key, for messages
  fn = None  # a function of `layers.relative_bias`

  def bias_params(self):
    """The pytree of arrays `fn` reads."""
    raise NotImplementedError

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    del is_causal  # |i - j|: causal decoders mask j > i anyway; encoders get the symmetric form
    if q_pos is None:
      q_pos = jnp.arange(q.shape[1])[None]  # [1, T]
    if k_pos is None:
      k_pos = jnp.arange(k.shape[1])[None]  # [1, S]
    return q, k, contract.ScoreTerms(position_bias=relative_bias.PositionBias(
        type(self).fn, self.bias_params(), q_pos, k_pos))


def _uniform(rngs, shape, bound):
  """PyTorch's nn.Linear init, U(-bound, bound) with bound = 1/sqrt(fan_in) (FIRE's listing)."""
  return nnx.Param(jax.random.uniform(rngs.params(), shape, jnp.float32, -bound, bound))


class FIRE(LearnedBias):
  """FIRE (Li et al. 2023): an MLP of the progressively interpolated log distance,
  one bias per head.

  One MLP per stack, shared by its layers (as the T5 table). Parameters as the paper's listing:
  hidden width 32, c initialised to 0.1, the threshold L = |multiplier * L_init| with the multiplier
  learned from 1.0 and L_init = `model.fire_threshold`.
  """

  name = 'fire'
  fn = staticmethod(relative_bias.fire_bias)
  options = ('fire_mlp_width', 'fire_threshold')
  param_form = '2·W + W·N + N + 2 per stack (W = fire_mlp_width)'

  @classmethod
  def param_count(cls, model_cfg, max_length):
    """w1, b1 `[W]`, w2 `[W, N]`, b2 `[N]`, c and the threshold's multiplier."""
    del max_length
    w, n = model_cfg.fire_mlp_width, model_cfg.num_heads
    return 2 * w + w * n + n + 2

  def __init__(self, num_heads, *, mlp_width=32, threshold=512.0, rngs):
    self.init_threshold = float(threshold)
    self.w1 = _uniform(rngs, (mlp_width,), 1.0)  # fan_in 1
    self.b1 = _uniform(rngs, (mlp_width,), 1.0)
    self.w2 = _uniform(rngs, (mlp_width, num_heads), mlp_width ** -0.5)
    self.b2 = _uniform(rngs, (num_heads,), mlp_width ** -0.5)
    self.c = nnx.Param(jnp.array(0.1, jnp.float32))
    self.threshold = nnx.Param(jnp.array(1.0, jnp.float32))  # L's learned multiplier

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    del max_length  # L_init is a config value: a model rebuilt for a longer eval keeps it
    return cls(cfg.num_heads, mlp_width=cfg.fire_mlp_width, threshold=cfg.fire_threshold,
               rngs=rngs)

  @classmethod
  def check_options(cls, model_cfg):
    m = model_cfg
    if not isinstance(m.fire_mlp_width, int) or isinstance(m.fire_mlp_width, bool) or (
        m.fire_mlp_width < 1):
      raise options.ConfigError(f'model.fire_mlp_width={m.fire_mlp_width!r} must be a positive '
                                'integer')
    options.positive('model.fire_threshold', m.fire_threshold)

  def bias_params(self):
    return {'c': self.c[...], 'threshold': self.threshold[...],
            'init_threshold': jnp.float32(self.init_threshold), 'w1': self.w1[...],
            'b1': self.b1[...], 'w2': self.w2[...], 'b2': self.b2[...]}


class KERPLE(LearnedBias):
  """KERPLE, logarithmic variant (Chi et al. 2022): -r1 log(1 + r2 |i - j|) with r1, r2 per head.

  Initialised as the reference code: r1 ~ U(0, 2), r2 ~ U(0, 1); both clamped to >= 0.01 in use.
  """

  name = 'kerple'
  fn = staticmethod(relative_bias.kerple_log_bias)
  param_form = '2·N per stack'

  @classmethod
  def param_count(cls, model_cfg, max_length):
    del max_length
    return 2 * model_cfg.num_heads

  def __init__(self, num_heads, *, rngs):
    self.r1 = nnx.Param(2.0 * jax.random.uniform(rngs.params(), (num_heads,), jnp.float32))
    self.r2 = nnx.Param(jax.random.uniform(rngs.params(), (num_heads,), jnp.float32))

  @classmethod
  def from_config(cls, cfg, max_length, *, rngs):
    del max_length
    return cls(cfg.num_heads, rngs=rngs)

  def bias_params(self):
    return {'r1': self.r1[...], 'r2': self.r2[...]}


# Position methods, keyed by `config.model.position`; each has `from_config(config.model,
# max_length, rngs=)`, the checks of layers.options.Configurable and `terms`.
POSITIONS = {
    'nope': Position,
    'sinusoidal': Sinusoidal,
    'learned': Learned,
    'rope': rope.RoPE,
    'alibi': ALiBi,
    't5_bias': T5Bias,
    'fire': FIRE,
    'kerple': KERPLE,
    'xpos': rope.XPos,
}
# The methods that read absolute position ids, which `model.random_positions_max` randomizes.
RANDOM_POSITIONS = tuple(name for name, p in POSITIONS.items() if p.random_ids)


def make(cfg, max_length, *, rngs):
  """Builds the position method `cfg.position` (a key of POSITIONS).

  Args:
    cfg: `config.model` (position, d_model, num_heads, and rope_* / t5_* for those methods).
    max_length: the training length (learned tables; YaRN's original context).
    rngs: parameter initialisation.
  """
  return options.lookup('model.position', POSITIONS, cfg.position).from_config(
      cfg, max_length, rngs=rngs)


def set_eval_options(model, model_cfg, fields):
  """Applies `config.model`'s evaluation-time `fields` to every position method of a built NNX
  model that declares them (`eval_options`), in place: no parameter changes, so it applies to a
  restored checkpoint (eval.py's --rope_scaling, --xpos_block). Split the model (or re-split)
  after calling this.

  Raises:
    ValueError: no position method of the model declares every field of `fields`.
  """
  found = [node for _, node in nnx.iter_graph(model)
           if fields and set(fields) <= set(getattr(node, 'eval_options', ()))]
  if not found:
    raise ValueError(f'the model has no position method that changes {", ".join(fields)} at '
                     f'evaluation (config.model.position={model_cfg.position!r})')
  for node in found:
    node.set_eval_options(model_cfg)
  return model


def shift_matrix(delta, d_model, base=10000.0):
  """The `[D, D]` matrix M with PE(p + delta) = M @ PE(p) for the sinusoidal table
  (block rotations)."""
  inv_freq = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  m = np.zeros((d_model, d_model))
  for i, w in enumerate(inv_freq):
    c, s = np.cos(delta * w), np.sin(delta * w)
    # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
    m[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, s], [-s, c]]
  return m
