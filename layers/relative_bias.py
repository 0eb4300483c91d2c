"""Learned score biases computed from positions: FIRE (Li et al. 2023) and KERPLE-log
(Chi et al. 2022).

A bias of this kind is a small function of the query and key positions with learned parameters. The
kernels take it as a `PositionBias`: the dense kernel (attention_xla) evaluates it on the whole
`[T, S]` grid, the blockwise kernel on each tile's positions only, so its memory stays O(T).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

# KERPLE's reference code (chijames/KERPLE) clamps r1, r2 to at least this after every step;
# here the
# clamp is in the forward pass, so the parameters themselves are left as the optimiser moves them.
KERPLE_EPS = 1e-2
# FIRE's listing (Li et al. 2023, appendix) adds this to the normaliser, ψ(max(L, i)) + eps.
FIRE_EPS = 1e-6


class PositionBias(NamedTuple):
  """A score bias `fn(params, q_pos, k_pos)` of the positions, given to the kernels unevaluated.

  Attributes:
    fn: `fn(params, q_pos [B|1, T, 1], k_pos [B|1, 1, S]) -> [B|1, N, T, S]` float32; a
      module-level function (the blockwise kernel keeps it in its static config).
    params: the pytree of learned arrays `fn` reads (the blockwise kernel differentiates them).
    q_pos: `[B|1, T]` int query positions.
    k_pos: `[B|1, S]` int key positions.
  """
  fn: Callable
  params: Any
  q_pos: jax.Array
  k_pos: jax.Array

  def dense(self):
    """The bias on the whole grid, `[B|1, N, T, S]` float32 (the dense kernel, cached decoding)."""
    return self.fn(self.params, self.q_pos[:, :, None], self.k_pos[:, None, :])


def fire_bias(params, q_pos, k_pos):
  """FIRE: b(i, j) = f(ψ(i - j) / ψ(max(L, i))), ψ(x) = log(|c x| + 1),
  f an MLP to one value per head.

  As the paper's listing: the threshold is |L_multiplier * L_init| (L_init fixed, the multiplier
  learned), and the MLP has one ReLU hidden layer. |i - j| is used, so the masked (j > i) entries
  of a causal decoder stay finite and an encoder gets the symmetric form.

  Args:
    params: {'c': [], 'threshold': [] (the multiplier), 'init_threshold': [] (L_init, not
      trained), 'w1', 'b1': [W], 'w2': [W, N], 'b2': [N]}.
    q_pos: `[B|1, T, 1]` int; k_pos: `[B|1, 1, S]` int.

  Returns:
    `[B|1, N, T, S]` float32.
  """
  dist = jnp.abs(q_pos - k_pos).astype(jnp.float32)  # [B, T, S]
  c = params['c']
  threshold = jnp.abs(params['threshold'] * jax.lax.stop_gradient(params['init_threshold']))
  normaliser = jnp.log(jnp.abs(c * jnp.maximum(q_pos.astype(jnp.float32), threshold)) + 1.0)
  # Progressive interpolation: distances are divided by the (log) query position, so at every
  # query position the inputs of f lie in [0, 1], whatever the length.
  x = jnp.log(jnp.abs(c * dist) + 1.0) / (normaliser + FIRE_EPS)  # [B, T, S]
  hidden = jax.nn.relu(x[..., None] * params['w1'] + params['b1'])  # [B, T, S, W]
  return (jnp.einsum('BTSW,WN->BNTS', hidden, params['w2'])
          + params['b2'][:, None, None])  # [B, N, T, S]


def kerple_log_bias(params, q_pos, k_pos):
  """KERPLE's logarithmic variant: b(i, j) = -r1 log(1 + r2 |i - j|), r1, r2 > 0 per head.

  Args:
    params: {'r1': [N], 'r2': [N]} (clamped to >= KERPLE_EPS here, as the reference code does).
    q_pos: `[B|1, T, 1]` int; k_pos: `[B|1, 1, S]` int.

  Returns:
    `[B|1, N, T, S]` float32.
  """
  dist = jnp.abs(q_pos - k_pos).astype(jnp.float32)[:, None]  # [B, 1, T, S]
  r1 = jnp.maximum(params['r1'], KERPLE_EPS)[:, None, None]  # [N, 1, 1]
  r2 = jnp.maximum(params['r2'], KERPLE_EPS)[:, None, None]
  return -r1 * jnp.log1p(r2 * dist)  # [B, N, T, S]
