"""Position information, keyed by `config.model.position`.

A position object has two hooks: `embed(x, positions)` for absolute methods that add a vector to the
token embeddings, and `in_attention(q, k, q_pos, k_pos, is_causal=...)` for methods that act on the
scores (RoPE rotates q and k; ALiBi and T5 add a bias). Each method implements the one it needs.
"""

import jax.numpy as jnp
import numpy as np
from flax import nnx


class Position(nnx.Module):
  """No position information (NoPE): self-attention is then permutation-equivariant."""

  def embed(self, x, positions):
    del positions
    return x

  def in_attention(self, q, k, q_pos, k_pos, *, is_causal):
    del q_pos, k_pos, is_causal
    return q, k, {}

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
  # Interleave sin and cos so each frequency's pair is a 2-D rotation: PE(p + delta) = M(delta) PE(p).
  return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions.shape, d_model)


class Sinusoidal(Position):
  """Fixed sinusoidal positions added to the embeddings."""

  def __init__(self, d_model, max_length, *, rngs):
    del max_length, rngs
    self.d_model = d_model

  def embed(self, x, positions):
    return x + sinusoid_table(positions, self.d_model).astype(x.dtype)  # [B, T, D]


class Learned(Position):
  """A learned table of `max_length` rows added to the embeddings; longer inputs are an error."""

  def __init__(self, d_model, max_length, *, rngs):
    self.max_length = max_length
    self.table = nnx.Embed(max_length, d_model, rngs=rngs,
                           embedding_init=nnx.initializers.normal(stddev=0.02))

  def check_length(self, length):
    if length > self.max_length:
      raise ValueError(f'position=learned has a table of max_length={self.max_length} rows; '
                       f'cannot embed {length} positions (train longer or use another position)')

  def embed(self, x, positions):
    self.check_length(x.shape[1])
    return x + self.table(positions).astype(x.dtype)  # [B, T, D]


def no_position(d_model, max_length, *, rngs):
  del d_model, max_length, rngs
  return Position()


POSITIONS = {
    'nope': no_position,
    'sinusoidal': Sinusoidal,
    'learned': Learned,
}


def make(name, d_model, max_length, *, rngs):
  """Builds the position method `name` (a key of POSITIONS)."""
  if name not in POSITIONS:
    raise ValueError(f'position {name!r} unknown; valid: {sorted(POSITIONS)}')
  return POSITIONS[name](d_model, max_length, rngs=rngs)


def shift_matrix(delta, d_model, base=10000.0):
  """The `[D, D]` matrix M with PE(p + delta) = M @ PE(p) for the sinusoidal table (block rotations)."""
  inv_freq = base ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  m = np.zeros((d_model, d_model))
  for i, w in enumerate(inv_freq):
    c, s = np.cos(delta * w), np.sin(delta * w)
    # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
    m[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[c, s], [-s, c]]
  return m
