"""Mixture-of-experts feed-forward layer: a router, E stacked experts, optional shared experts."""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from layers import feed_forward
from layers import initializers
from layers import moe_sharded
from layers import options
from layers import sharding

# `config.model.moe_routing`: token choice (each token picks its top-k experts: Switch, GShard,
# Mixtral) or expert choice (each expert picks its top-capacity tokens: Zhou et al. 2022).
ROUTINGS = ('tokens', 'experts')
# Every `model.moe_*` field and its default (configs/default.py holds the same values, commented).
DEFAULTS = {
    'moe_experts': 0, 'moe_d_ff': 0, 'moe_top_k': 2, 'moe_capacity_factor': 0.0,
    'moe_routing': 'tokens', 'moe_router_jitter': 0.0, 'moe_shared_experts': 0, 'moe_every': 1,
    'moe_first_dense': 0, 'moe_aux_loss': 0.01, 'moe_z_loss': 0.0, 'moe_bias_rate': 0.0,
    'moe_buffer_factor': 0.0,
}
# What each MoE layer sows (nnx.Intermediate 'moe'), one scalar each; training.steps averages
# them over the MoE layers.
STATS = ('aux_loss', 'z_loss', 'drop_fraction', 'load_cv')
# The logical axes of the experts' inputs and outputs `[E, B, C, D]` (capacity and expert choice):
# pinned to the expert axis, so that GSPMD moves the batch-sharded tokens to their experts' devices
# (an all-to-all over `mesh.expert`) and back (layers.sharding).
EXPERT_SLOTS = ('expert', 'batch', None, 'act_embed')


def is_moe_layer(cfg, layer):
  """Whether block `layer` (0-based, within its stack) is MoE: after `moe_first_dense` dense
  blocks, every `moe_every`-th block, counting from 1 (moe_every=2: the 2nd, 4th, ... of them,
  GShard's and Switch's every other FFN; 1: all)."""
  if not cfg.get('moe_experts', 0) or layer is None:
    return False
  first, every = cfg.get('moe_first_dense', 0), cfg.get('moe_every', 1)
  return layer >= first and (layer - first + 1) % every == 0


def num_moe_layers(cfg):
  """The number of MoE blocks in one stack of `cfg.num_layers` blocks."""
  return sum(is_moe_layer(cfg, i) for i in range(cfg.num_layers))


def expert_width(cfg):
  """F_e, each expert's (and each shared expert's) width: `moe_d_ff`, or d_ff when it is 0."""
  return cfg.get('moe_d_ff', 0) or cfg.d_ff


def capacity(capacity_factor, top_k, tokens, num_experts):
  """Slots per expert per group: ceil(C·k·tokens/E), at most `tokens`."""
  return min(tokens, max(1, math.ceil(capacity_factor * top_k * tokens / num_experts)))


class RouterBias(nnx.Variable):
  """The per-expert selection bias of auxiliary-loss-free balancing (`MoE.update_bias`): a model
  variable that is not a parameter (no gradient; checkpointed with the buffers)."""


def _stacked(init):
  """`init` of a `[E, ...]` parameter: each expert's slice drawn as its own 2-D kernel (a plain
  3-D variance scaling would count E into the fan-in)."""
  def stacked(key, shape, dtype=jnp.float32):
    keys = jax.random.split(key, shape[0])
    return jax.vmap(lambda k: init(k, shape[1:], dtype))(keys)
  return stacked


def router_stats(logits, probs, load, top_k):
  """The balancing terms of one layer.

  Args:
    logits: `[N, E]` float32 router logits of N tokens.
    probs: `[N, E]` their softmax.
    load: `[E]` assignments each expert was routed (before any capacity drop).
    top_k: k.

  Returns:
    {'aux_loss': E · sum_e f_e · P_e (Switch/GShard), f_e = load_e / (k·N) the share of the
     assignments routed to e, P_e the mean router probability of e: 1 when balanced;
     'z_loss': mean over tokens of logsumexp(logits)^2 (ST-MoE); 'load_cv': std/mean of load}.
  """
  n, e = probs.shape
  f = load / (top_k * n)  # [E]
  p = jnp.mean(probs, 0)  # [E]
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, -1)))
  cv = jnp.std(load) / jnp.maximum(jnp.mean(load), 1e-9)
  return {'aux_loss': e * jnp.sum(jax.lax.stop_gradient(f) * p), 'z_loss': z, 'load_cv': cv}


class MoE(nnx.Module, options.Configurable):
  """E experts, each an FFN of `model.ffn`'s kind (D -> F_e -> D, no biases), stacked as
  `[E, D, F]` / `[E, F, D]` (logical axes 'expert', 'embed', 'mlp'), and a float32 router.

  Token choice (`routing='tokens'`): softmax over the E router logits, each token's top-k experts,
  combine weights the top-k probabilities renormalised to sum to 1 (Mixtral's convention), except
  for k = 1, where the expert's output is weighed by its unnormalised probability p_i(x) (Switch's
  form: renormalised, the single weight would always be 1, and the router would learn from the
  balancing losses alone). With `capacity_factor` C > 0 each expert takes at most
  ceil(C·k·T/E) assignments per group (one batch row); the slots go first to every token's first
  choice in position order, then to the second choices in position order, and so on (GShard's
  order): an assignment past the capacity is dropped, and a token all of whose assignments are
  dropped gets 0 here (the block's residual carries it). C = 0 is dropless: the assignments,
  sorted by expert, run through `jax.lax.ragged_dot`. Evaluation and decoding (no `rngs`) are
  always dropless, so a token's output never depends on the other tokens of its row and the
  cached step equals the full forward pass.

  Expert choice (`routing='experts'`): each expert takes the ceil(C·k·T/E) tokens of the group
  with the highest probability for it, weighted by that probability; a token may be taken by
  several experts or none. It sees the whole row, so it is for non-causal stacks only.

  Auxiliary-loss-free balancing (`bias_rate` = gamma > 0, DeepSeek-V3): a per-expert bias b (a
  `RouterBias`, zeros at initialisation) is added to the probabilities for choosing the top-k only;
  the combine weights stay the unbiased probabilities of the chosen experts (renormalised for
  k > 1). After
  every training step b_e += gamma · sign(mean load - load_e) (`update_bias`, called by
  training.steps with the step's loads): an overloaded expert is chosen less, an idle one more.

  Shared experts (DeepSeekMoE) are one always-on FFN of width S·F_e, equal to S experts of width
  F_e summed. Router jitter multiplies the router's input by U(1 - eps, 1 + eps) while training.
  """

  options = tuple(DEFAULTS)

  def __init__(self, d_model, d_ff, num_experts, ffn='relu', *, top_k=2, capacity_factor=0.0,
               routing='tokens', jitter=0.0, shared_experts=0, bias_rate=0.0, buffer_factor=0.0,
               kernel_init=None, rngs):
    ffn_entry = options.lookup('model.ffn', feed_forward.FFNS, ffn)
    self.activation = ffn_entry.activation  # the dense FFN's, not a copy
    self.gated = ffn_entry.module is feed_forward.GatedFeedForward
    self.num_experts, self.top_k, self.routing = num_experts, top_k, routing
    self.capacity_factor, self.jitter, self.bias_rate = capacity_factor, jitter, bias_rate
    self.buffer_factor = buffer_factor
    self.router_bias = RouterBias(jnp.zeros((num_experts,), jnp.float32)) if bias_rate else None
    init = kernel_init or nnx.initializers.lecun_normal()
    e, d, f = num_experts, d_model, d_ff
    self.router = nnx.Param(init(rngs.params(), (d, e), jnp.float32),
                            logical_axes=('embed', 'expert'))  # [D, E]

    def expert_param(shape, names):
      return nnx.Param(_stacked(init)(rngs.params(), shape), logical_axes=names)

    self.wi = expert_param((e, d, f), ('expert', 'embed', 'mlp'))  # [E, D, F]
    self.up = expert_param((e, d, f), ('expert', 'embed', 'mlp')) if self.gated else None
    self.wo = expert_param((e, f, d), ('expert', 'mlp', 'embed'))  # [E, F, D]
    self.shared = (feed_forward.make(ffn, d, shared_experts * f, kernel_init=kernel_init,
                                     rngs=rngs) if shared_experts else None)

  @classmethod
  def from_config(cls, cfg, *, rngs):
    """The MoE layer of `config.model` (resolved)."""
    return cls(cfg.d_model, expert_width(cfg), cfg.moe_experts, cfg.ffn,
               top_k=cfg.get('moe_top_k', 2), capacity_factor=cfg.get('moe_capacity_factor', 0.0),
               routing=cfg.get('moe_routing', 'tokens'), jitter=cfg.get('moe_router_jitter', 0.0),
               shared_experts=cfg.get('moe_shared_experts', 0),
               bias_rate=cfg.get('moe_bias_rate', 0.0),
               buffer_factor=cfg.get('moe_buffer_factor', 0.0),
               kernel_init=initializers.kernel_init(cfg), rngs=rngs)

  @classmethod
  def check_options(cls, model_cfg):
    """Each moe_* value on its own, and none set (off its default) while moe_experts = 0."""
    get = lambda name: model_cfg.get(name, DEFAULTS[name])
    for name in ('moe_experts', 'moe_d_ff', 'moe_shared_experts', 'moe_first_dense'):
      if not isinstance(get(name), int) or isinstance(get(name), bool) or get(name) < 0:
        raise options.ConfigError(f'model.{name}={get(name)!r} must be a non-negative integer')
    for name in ('moe_top_k', 'moe_every'):
      if not isinstance(get(name), int) or isinstance(get(name), bool) or get(name) < 1:
        raise options.ConfigError(f'model.{name}={get(name)!r} must be a positive integer')
    for name in ('moe_capacity_factor', 'moe_router_jitter', 'moe_aux_loss', 'moe_z_loss',
                 'moe_bias_rate', 'moe_buffer_factor'):
      options.positive(f'model.{name}', get(name), zero_ok=True)
    if 0 < get('moe_buffer_factor') < 1:
      raise options.ConfigError(f'model.moe_buffer_factor={get("moe_buffer_factor")!r} would drop '
                                'assignments of a balanced load; valid values: 0 (worst case) '
                                'or >= 1')
    if get('moe_router_jitter') >= 1:
      raise options.ConfigError(f'model.moe_router_jitter={get("moe_router_jitter")!r} must be '
                                'in [0, 1)')
    options.choice('model.moe_routing', get('moe_routing'), ROUTINGS)
    if get('moe_experts') == 0:
      for name, default in DEFAULTS.items():
        if get(name) != default:
          raise options.ConfigError(f'model.{name}={get(name)!r} is set but model.moe_experts=0 '
                                    f'(dense); valid values: {default!r}, or moe_experts > 0')

  @classmethod
  def check_config(cls, model_cfg, data_cfg, *, causal=True):
    """The combinations: k <= E, expert choice only without causal self-attention and with a
    capacity, at least one MoE block, no scanned stack.

    Args:
      model_cfg, data_cfg: as `layers.options.Configurable.check_config`.
      causal: the model has a causal stack (the caller reads the architecture's declaration,
        models.contract.ArchSpec.causal), where expert choice would let a token's routing depend
        on later tokens of its row.
    """
    del data_cfg
    m = model_cfg
    e = m.get('moe_experts', 0)
    if not e:
      return
    if m.moe_top_k > e:
      raise options.ConfigError(f'model.moe_top_k={m.moe_top_k} exceeds model.moe_experts={e}; '
                                f'valid values: 1..{e}')
    if m.moe_routing == 'experts' and causal:
      raise options.ConfigError(f"model.moe_routing='experts' (expert choice) reads later tokens, "
                                f"which causal model.arch={m.arch!r} must not; "
                                "valid values: tokens")
    if m.moe_routing == 'experts' and m.get('moe_bias_rate', 0.0):
      raise options.ConfigError("model.moe_bias_rate balances token choice; expert choice "
                                "(model.moe_routing='experts') is balanced by construction; "
                                "valid values: 0")
    if m.get('moe_buffer_factor', 0.0) and (m.moe_capacity_factor or m.moe_routing != 'tokens'):
      raise options.ConfigError(f'model.moe_buffer_factor={m.moe_buffer_factor!r} sizes the '
                                'dropless receive buffer; valid values: 0 with '
                                "model.moe_capacity_factor > 0 or model.moe_routing='experts'")
    if m.moe_routing == 'experts' and m.moe_capacity_factor == 0:
      raise options.ConfigError("model.moe_capacity_factor=0 (dropless) has no capacity for "
                                "model.moe_routing='experts' to fill; valid values: > 0")
    if num_moe_layers(m) == 0:
      raise options.ConfigError(f'model.moe_first_dense={m.moe_first_dense} with model.moe_every='
                                f'{m.moe_every} leaves no MoE block in {m.num_layers} layers; '
                                f'valid values: moe_first_dense + moe_every <= {m.num_layers}')
    if m.get('scan_layers', False):
      raise options.ConfigError('model.scan_layers=True stacks identical blocks, which MoE blocks '
                                'are not yet; valid values: False with model.moe_experts > 0')

  # --- forward --------------------------------------------------------------------------------

  def __call__(self, x, rngs=None, *, sow=True):
    """Args:
      x: `[B, T, D]`.
      rngs: with a `dropout` stream while training (router jitter, capacity); None: evaluation
        and decoding, dropless.
      sow: sow the balancing terms (`STATS`) as `nnx.Intermediate` 'moe' (decode passes False).

    Returns:
      `[B, T, D]`.
    """
    b, t, d = x.shape
    router_in = x.astype(jnp.float32)
    if rngs is not None and self.jitter > 0:
      router_in = router_in * jax.random.uniform(
          rngs.dropout(), router_in.shape, jnp.float32, 1 - self.jitter, 1 + self.jitter)
    logits = jnp.einsum('BTD,DE->BTE', router_in, self.router[...])  # [B, T, E] float32
    if self.routing == 'experts':
      y, stats = self.expert_choice(x, logits)
    else:
      dropless = rngs is None or self.capacity_factor == 0
      y, stats = self.token_choice(x, logits, None if dropless else self.capacity_factor,
                                   buffer_factor=0.0 if rngs is None else self.buffer_factor)
    if self.shared is not None:
      y = y + self.shared(x)
    if sow:
      self.sow(nnx.Intermediate, 'moe', stats)
    return y.astype(x.dtype)

  def update_bias(self, load):
    """b_e += gamma · sign(mean(load) - load_e): one step of auxiliary-loss-free balancing, from
    the assignments `load` `[E]` each expert was routed in the step."""
    load = jax.lax.stop_gradient(load.astype(jnp.float32))
    self.router_bias[...] = self.router_bias[...] + self.bias_rate * jnp.sign(
        jnp.mean(load) - load)

  def decode(self, x):
    """One cached decoding step `[B, 1, D]`: dropless token choice, nothing sown."""
    return self(x, sow=False)

  def expert_params(self, dtype):
    """The stacked experts' weights in `dtype`: {'wi', 'wo', and 'up' when gated}."""
    params = {'wi': self.wi[...].astype(dtype), 'wo': self.wo[...].astype(dtype)}
    if self.gated:
      params['up'] = self.up[...].astype(dtype)
    return params

  def grouped_experts(self, h, group_sizes, params):
    """The experts on `[M, D]` rows sorted by expert, `group_sizes` `[G]` rows each, with
    `params` of G experts (`expert_params`, or one device's share of them) -> `[M, D]`."""
    mm = lambda a, w: moe_sharded.grouped_matmul(a, w, group_sizes)  # noqa: E731
    hidden = self.activation(mm(h, params['wi']))  # [M, F]
    if self.gated:
      hidden = hidden * mm(h, params['up'])
    return mm(hidden, params['wo'])

  def experts(self, h):
    """The experts on their inputs: `[E, B, C, D]` -> `[E, B, C, D]` (capacity, expert choice)."""
    params = self.expert_params(h.dtype)
    h = sharding.constrain(h, EXPERT_SLOTS)
    mm = lambda a, w: jnp.einsum('EBCD,EDF->EBCF', a, w)  # noqa: E731
    hidden = self.activation(mm(h, params['wi']))  # [E, B, C, F]
    if self.gated:
      hidden = hidden * mm(h, params['up'])
    return sharding.constrain(mm(hidden, params['wo']), EXPERT_SLOTS)

  def token_choice(self, x, logits, capacity_factor=None, *, buffer_factor=0.0):
    """Token choice of `x` `[B, T, D]` by `logits` `[B, T, E]`; `capacity_factor` None: dropless
    (with `buffer_factor` > 0, under expert parallelism, up to that receive buffer).

    Returns:
      (`[B, T, D]`, the layer's `STATS`).
    """
    b, t, d = x.shape
    e, k = self.num_experts, self.top_k
    probs = jax.nn.softmax(logits, -1)  # [B, T, E]
    if self.router_bias is None:
      top_p, top_i = jax.lax.top_k(probs, k)  # [B, T, k]
    else:  # the bias chooses; the probabilities weigh
      _, top_i = jax.lax.top_k(probs + self.router_bias[...], k)
      top_p = jnp.take_along_axis(probs, top_i, -1)
    # k > 1: renormalised to sum 1 (Mixtral). k = 1: the gate itself (Switch), since the
    # renormalised single weight is always 1 and would give the router no gradient from the task.
    weights = top_p if k == 1 else top_p / jnp.sum(top_p, -1, keepdims=True)
    chosen = jax.nn.one_hot(top_i, e, dtype=jnp.float32)  # [B, T, k, E]
    load = jnp.sum(chosen, (0, 1, 2))  # [E]
    if capacity_factor is None:
      y, kept = self._dropless(x, top_i, weights, buffer_factor)
    else:
      y, kept = self._with_capacity(x, chosen, weights, capacity(capacity_factor, k, t, e))
    stats = router_stats(logits.reshape(-1, e), probs.reshape(-1, e), load, k)
    stats['drop_fraction'] = 1.0 - kept / (b * t * k)
    if self.router_bias is not None:
      stats['load'] = load  # for update_bias (training.steps), not a log metric
    return y, stats

  def _dropless(self, x, top_i, weights, buffer_factor=0.0):
    """Every assignment, sorted by expert and run through grouped matmuls: per device under
    expert parallelism (layers.moe_sharded; up to its receive buffer), else on the whole batch.
    Returns the output and the number of assignments kept."""
    params = self.expert_params(x.dtype)
    found = moe_sharded.dropless(x, top_i, weights, params, self.grouped_experts,
                                 self.num_experts, buffer_factor)
    if found is not None:
      y, kept = found
      return y, kept.astype(jnp.float32)
    b, t, d = x.shape
    k = self.top_k
    flat = top_i.reshape(-1)  # [M = B·T·k]
    order = jnp.argsort(flat, stable=True)  # [M]
    sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)  # [E]
    rows = x.reshape(-1, d)[order // k]  # [M, D] token of each sorted assignment
    out = self.grouped_experts(rows, sizes, params)  # [M, D]
    out = jnp.zeros_like(out).at[order].set(out).reshape(b, t, k, d)  # back in token order
    return (jnp.einsum('BTKD,BTK->BTD', out, weights.astype(x.dtype)),
            jnp.asarray(b * t * k, jnp.float32))

  def _with_capacity(self, x, chosen, weights, cap):
    """Assignments up to `cap` per expert and row, in GShard's order (all first choices by
    position, then all second choices, ...); returns (`[B, T, D]`, assignments kept)."""
    b, t, k, e = chosen.shape
    by_rank = chosen.transpose(0, 2, 1, 3).reshape(b, k * t, e)  # [B, k·T, E] rank-major order
    slot = jnp.cumsum(by_rank, 1) - 1  # [B, k·T, E] the slot each assignment would take
    keep = by_rank * (slot < cap)
    slots = keep[..., None] * jax.nn.one_hot(slot, cap, dtype=jnp.float32)  # [B, k·T, E, C]
    slots = slots.reshape(b, k, t, e, cap)
    dispatch = jnp.sum(slots, 1).astype(x.dtype)  # [B, T, E, C] (the k experts are distinct)
    combine = jnp.einsum('BKTEC,BTK->BTEC', slots, weights).astype(x.dtype)
    out = self.experts(jnp.einsum('BTEC,BTD->EBCD', dispatch, x))  # [E, B, C, D]
    return jnp.einsum('EBCD,BTEC->BTD', out, combine), jnp.sum(keep)

  def expert_choice(self, x, logits):
    """Expert choice: each expert's top-capacity tokens of each row, weighted by its probability.

    Returns:
      (`[B, T, D]`, the layer's `STATS`; drop_fraction is the share of tokens no expert took).
    """
    b, t, d = x.shape
    e = self.num_experts
    cap = capacity(self.capacity_factor, self.top_k, t, e)
    probs = jax.nn.softmax(logits, -1)  # [B, T, E]
    gate, token = jax.lax.top_k(probs.transpose(0, 2, 1), cap)  # [B, E, C]
    dispatch = jax.nn.one_hot(token, t, dtype=x.dtype)  # [B, E, C, T]
    out = self.experts(jnp.einsum('BECT,BTD->EBCD', dispatch, x))  # [E, B, C, D]
    y = jnp.einsum('EBCD,BECT,BEC->BTD', out, dispatch, gate.astype(x.dtype))
    taken = jnp.sum(dispatch, (1, 2)) > 0  # [B, T]
    load = jnp.sum(dispatch, (0, 2, 3)).astype(jnp.float32)  # [E]
    stats = router_stats(logits.reshape(-1, e), probs.reshape(-1, e), load, load.sum() / (b * t))
    stats['drop_fraction'] = 1.0 - jnp.mean(taken.astype(jnp.float32))
    return y, stats
