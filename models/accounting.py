"""Parameters, FLOPs and memory of a config: counted on the real model, checked in closed form.

The library under `python -m tools.accounting`, which prints these numbers as tables. Parameters
are counted on `jax.eval_shape` of `models.build` (shapes only, nothing allocated) and compared
with the closed forms below; FLOPs, KV-cache, score and per-device memory are closed forms over the
config's sizes, the per-device part read from the same logical-axis rules that training places the
state with (`layers.sharding`), on an abstract mesh of `config.mesh`'s sizes (any sizes: no devices
are needed). Every function takes a resolved config (`d_ff` and `num_kv_heads` filled in). Legend:
B batch, T length, S key length, D d_model, N heads, K KV heads, H head dim, F d_ff, V vocabulary,
L layers per stack.
"""

import collections
import math

import jax
from flax import nnx

import models
from layers import attention
from layers import attention_heads
from layers import attention_variants
from layers import block
from layers import flash_core
from layers import initializers
from layers import moe
from layers import positions
from layers import sharding

COMPONENTS = ('embedding', 'positions', 'attention', 'cross_attention', 'ffn', 'norms', 'output')
GATED_FFNS = ('swiglu', 'geglu')


# --- Closed forms ---------------------------------------------------------------------------------

def attention_params(d_model, num_heads, num_kv_heads=None, *, use_bias=False, head_dim=None):
  """q, k, v, o projections (`layers.attention.projection_params`): D·N·H + 2·D·K·H + N·H·D
  (+ N·H + 2·K·H + D biases); 4·D² for MHA with N·H = D."""
  return attention.projection_params(d_model, num_heads, num_kv_heads, use_bias=use_bias,
                                     head_dim=head_dim)


def ffn_params(d_model, d_ff, ffn='relu', *, use_bias=False):
  """2·D·F (relu, gelu) or 3·D·F (gated: swiglu, geglu), (+ F + D or 2·F + D biases)."""
  mats = 3 if ffn in GATED_FFNS else 2
  return mats * d_model * d_ff + ((mats - 1) * d_ff + d_model if use_bias else 0)


def moe_layer_params(cfg):
  """One MoE block's FFN (layers.moe.MoE, no biases): {'router': D·E, 'experts': E·m·D·F_e with
  m = 2 (relu, gelu) or 3 (gated), 'shared': S·m·D·F_e, 'active': the router, the shared experts
  and k of the experts, what one token passes through}."""
  d, e, f = cfg.d_model, cfg.moe_experts, moe.expert_width(cfg)
  one = ffn_params(d, f, cfg.ffn)
  out = {'router': d * e, 'experts': e * one, 'shared': cfg.get('moe_shared_experts', 0) * one}
  out['active'] = out['router'] + out['shared'] + cfg.moe_top_k * one
  return out


def ffn_layers_params(cfg, *, active=False):
  """One stack's feed-forward parameters: dense blocks of width d_ff (with biases if configured)
  and MoE blocks (`moe_layer_params`; with `active`, only what one token uses)."""
  num_moe = moe.num_moe_layers(cfg)
  dense = ffn_params(cfg.d_model, cfg.d_ff, cfg.ffn, use_bias=initializers.ffn_bias(cfg))
  out = dense * (cfg.num_layers - num_moe)
  if num_moe:
    layer = moe_layer_params(cfg)
    out += num_moe * (layer['active'] if active else
                      layer['router'] + layer['experts'] + layer['shared'])
  return out


def active_params(cfg, vocab_size, max_length):
  """Parameters one token passes through: `formula_params` summed, with each MoE block counting
  its router, shared experts and k routed experts only (the total for a dense model)."""
  stacks, _ = stack_layout(cfg.arch)
  total = sum(formula_params(cfg, vocab_size, max_length).values())
  return total - stacks * (ffn_layers_params(cfg) - ffn_layers_params(cfg, active=True))


def norm_params(d_model, norm):
  """LayerNorm: scale and shift, 2·D; RMSNorm: scale only, D."""
  return 2 * d_model if norm == 'layernorm' else d_model


def covers(arch):
  """Whether the closed forms cover `arch`: it declares Transformer stacks (models.contract)."""
  return bool(models.spec(arch).stacks)


def stack_layout(arch):
  """(number of stacks, whether a stack has cross-attention) of a Transformer arch, from its
  declared stacks (`models.contract.ArchSpec.stacks`).

  Raises:
    ValueError: `arch` is not a Transformer (the closed forms cover only those).
  """
  if not covers(arch):
    valid = models.archs_where(lambda s: s.stacks, ordered=False)
    raise ValueError(f'model.arch={arch!r}: accounting covers the Transformer archs; '
                     f'valid values: {", ".join(valid)}')
  spec = models.spec(arch)
  return len(spec.stacks), spec.cross_attention


def _count_stacks(arch, field):
  """How many of `arch`'s stacks declare `field` (causal, cross_attention, positions)."""
  return sum(bool(getattr(s, field)) for s in models.spec(arch).stacks)


def self_attention_params(cfg):
  """One layer's self-attention as its variant declares it (`param_count`): the projections and
  the variant's own parameters (Linformer's E and F)."""
  return attention_variants.VARIANTS[cfg.attention].param_count(cfg)


def self_attention_layers_params(cfg):
  """Every stack's self-attention layers, each as its own variant declares it: a hybrid stack
  (`model.layer_pattern`) or an encoder-decoder's `decoder_attention` sums different variants."""
  counts = collections.Counter(name for names in models.layer_attentions(cfg).values()
                               for name in names)
  total = 0
  for name, layers in counts.items():
    layer_cfg = cfg
    if name != cfg.attention:
      layer_cfg = cfg.copy_and_resolve_references()
      layer_cfg.attention = name
    total += self_attention_params(layer_cfg) * layers
  return total


def formula_params(cfg, vocab_size, max_length):
  """Closed-form parameter counts per component (totals over all layers and stacks).

  Args:
    cfg: a resolved `config.model`.
    vocab_size: V.
    max_length: the length `models.build` is given (learned position tables).

  Returns:
    {component: count} over `COMPONENTS`; 'output' is 0 when the output projection is tied to
    the (decoder's) token embedding (model.tie_output), else D·V (+ V with model.output_bias).
    'norms' holds every parameter on the residual path: one norm per sublayer (two under
    sandwich, none under rezero, whose scalar gates it counts instead) and the final norms
    (layers.block.FINAL_NORM).
  """
  stacks, _ = stack_layout(cfg.arch)
  d, layers = cfg.d_model, cfg.num_layers * stacks
  cross_layers = cfg.num_layers * _count_stacks(cfg.arch, 'cross_attention')
  sublayers = 2 * layers + cross_layers  # self, ffn (+ cross)
  per_sublayer = {'sandwich': 2, 'rezero': 0}.get(cfg.norm_position, 1)  # norms per sublayer
  final_norms = stacks if block.FINAL_NORM[cfg.norm_position] else 0
  gates = sublayers if cfg.norm_position == 'rezero' else 0
  shared = cfg.get('share_embeddings', True) or stacks == 1
  return {
      'embedding': vocab_size * d * (1 if shared else 2),
      'positions': position_params(cfg, max_length) * _count_stacks(cfg.arch, 'positions'),
      'attention': self_attention_layers_params(cfg),
      # Cross-attention is the dense layer (layers.block), with the gate, QK-norm and sinks when on.
      'cross_attention': attention.Attention.param_count(cfg) * cross_layers,
      'ffn': ffn_layers_params(cfg) * stacks,  # MoE blocks: router, experts, shared experts
      'norms': norm_params(d, cfg.norm) * (sublayers * per_sublayer + final_norms) + gates,
      'output': 0 if cfg.get('tie_output', True) else (
          d * vocab_size + (vocab_size if cfg.get('output_bias', True) else 0)),
  }


def position_closed_form(cfg, max_length):
  """One stack's position parameters in closed form, as the method declares them (`param_count`):
  the cross-check of `position_params`."""
  return positions.POSITIONS[cfg.position].param_count(cfg, max_length)


def position_params(cfg, max_length):
  """One stack's position parameters, counted on the shapes the method builds (`nnx.eval_shape`
  of `layers.positions.make`, nothing allocated): any registered method, FIRE's MLP and KERPLE's
  per-head pairs included, with no closed form to keep in step."""
  method = nnx.eval_shape(lambda: positions.make(cfg, max_length, rngs=nnx.Rngs(0)))
  return sum(math.prod(var.get_value().shape) for _, var in _leaves(nnx.state(method, nnx.Param)))


def kv_cache_elements(num_layers, num_kv_heads, head_dim, length):
  """2 (K and V) x layers x K x H x length: the elements a sequence's self-attention cache holds."""
  return 2 * num_layers * num_kv_heads * head_dim * length


def kv_cache_per_token(cfg):
  """Elements a sequence's self-attention cache holds per token over all decoder layers: L x the
  decoder variant's declared `cache_per_token` (2·K·H for a key and a value per KV head; MLA's
  d_c + d_h^R); None for an architecture with no decoding stack (`ArchSpec.decoder`: encoder_only).
  """
  spec = models.spec(cfg.arch)
  if spec.decoder is None:
    return None
  variant = attention_variants.VARIANTS[spec.stack(spec.decoder).config(cfg).attention]
  return cfg.num_layers * variant.cache_per_token(cfg)


def score_bytes(length, bytes_per_element, *, key_length=None, with_softmax=False):
  """One head's `[T, S]` score matrix (x2 with the softmax output kept beside it)."""
  s = length if key_length is None else key_length
  return length * s * bytes_per_element * (2 if with_softmax else 1)


def forward_flops(cfg, vocab_size, length, tiles=None):
  """Forward FLOPs of one row of `length` tokens (encoder-decoder: `length` source and target).

  A matmul costs 2 FLOPs per parameter per token that passes through it (multiply and add); the
  token embedding is a gather (0) and the tied output projection a D x V matmul (2·D·V per output
  token). Attention scores cost 2·T·S·N·H for QK^T and as much for PV per layer, i.e. 4·T·S·D; the
  xla kernel computes the full T x S matrix and masks it, so 'scores' counts all of it and
  'scores_causal' the half a causal layer needs (T(T+1)/2 pairs). Exact-softmax count: for the
  sparse and linear variants it is the dense-equivalent, not their own cost. Norms, softmax,
  activations and position terms (O(T·D) or O(T·S·N) elementwise) are left out. An MoE block
  counts what a token passes through (`moe_layer_params`' 'active': the router's D·E, the k
  routed and the shared experts), not the idle experts nor the dispatch.

  Returns:
    {'matmul', 'scores', 'scores_causal'} FLOPs per row, and 'scores_tiled' (`tiled_pairs`) when
    `tiles` = (block_q, block_k) of a kernel that skips the tiles outside the causal band.
  """
  stacks, cross = stack_layout(cfg.arch)
  t, d, n = length, cfg.d_model, cfg.num_heads
  h, k = initializers.head_dim(cfg), cfg.num_kv_heads
  # An MoE block counts the router and the k experts (and shared experts) a token passes through.
  num_moe = moe.num_moe_layers(cfg)
  ffn = ffn_params(d, cfg.d_ff, cfg.ffn) * (cfg.num_layers - num_moe) + (
      num_moe * moe_layer_params(cfg)['active'] if num_moe else 0)
  # The output gate (model.attention_gate) is one more D x N(·H) matmul per attention layer.
  attention_weights = attention_params(d, n, k, head_dim=h) + d * attention_heads.gate_width(
      cfg, n, h)
  stack_weights = attention_weights * cfg.num_layers + ffn
  matmul = 2 * t * stack_weights * stacks + 2 * t * d * vocab_size
  full, triangle = t * t, t * (t + 1) // 2  # (query, key) pairs: all, and the causal ones
  pairs = full * cfg.num_layers * stacks  # self-attention, every stack
  # A causal stack (a decoder) needs only the triangle; an encoder needs every pair.
  causal_pairs = pairs - (full - triangle) * cfg.num_layers * _count_stacks(cfg.arch, 'causal')
  if cross:
    # q and o over target tokens, k and v over source tokens (both `length`): the same weights.
    matmul += 2 * t * attention_weights * cfg.num_layers
    pairs += full * cfg.num_layers
    causal_pairs += full * cfg.num_layers  # cross-attention sees the whole source
  out = {'matmul': matmul, 'scores': 4 * pairs * n * h, 'scores_causal': 4 * causal_pairs * n * h}
  if tiles:
    out['scores_tiled'] = 4 * tiled_pairs(cfg, t, tiles) * n * h
  return out


def tiled_pairs(cfg, length, tiles):
  """The (query, key) pairs of one row that a kernel cutting the scores into `tiles` = (block_q,
  block_k) computes: every tile of the padded matrix, but only the tiles inside the causal band
  of a causal stack (`flash_core.visited_tiles`; a window is not counted)."""
  bq, bk = tiles
  nq, nk = -(-length // bq), -(-length // bk)
  band = flash_core.TileConfig(scale=1.0, is_causal=True, window=None, q_len=length,
                               kv_len=length, block_q=bq, block_k=bk)
  full, kept = nq * bq * nk * bk, flash_core.visited_tiles(band, nq, nk) * bq * bk
  stacks, cross = stack_layout(cfg.arch)
  causal = _count_stacks(cfg.arch, 'causal')
  return cfg.num_layers * (full * (stacks - causal + int(cross)) + kept * causal)


# --- Counted from the real model ------------------------------------------------------------------

def abstract_model(cfg, vocab_size, max_length):
  """`models.build` under `nnx.eval_shape`: every variable a ShapeDtypeStruct, nothing allocated."""
  return nnx.eval_shape(lambda: models.build(cfg, vocab_size, max_length, rngs=nnx.Rngs(0)))


def component_of(path):
  """The component of a parameter path, e.g. ('decoder', 'blocks', 0, 'ffn', 'wi', 'kernel')."""
  names = [str(p) for p in path]
  for key, component in (('self_attention', 'attention'), ('cross_attention', 'cross_attention'),
                         ('ffn', 'ffn')):
    if key in names:
      return component
  if any(p.endswith('norm') or p.endswith('_gate') for p in names):
    return 'norms'  # ReZero's gates take the norms' place on the residual path
  if 'output' in names:
    return 'output'
  if 'position' in names:
    return 'positions'
  if 'embed' in names:
    return 'embedding'
  return 'other'


def _leaves(state):
  """(path, Variable) pairs of an `nnx.State`."""
  return list(nnx.to_flat_state(state))


def counted_params(model):
  """{component: parameter count} of a (possibly abstract) model's `nnx.Param`s; shared variables
  (a tied embedding) count once."""
  out = dict.fromkeys(COMPONENTS, 0)
  for path, var in _leaves(nnx.state(model, nnx.Param)):
    c = component_of(path)
    out[c] = out.get(c, 0) + math.prod(var.get_value().shape)
  return out


# --- Per-device memory under a mesh --------------------------------------------------------------

def abstract_mesh(mesh_config):
  """An `AbstractMesh` of `config.mesh`'s axis sizes: specs need the sizes, not devices."""
  return jax.sharding.AbstractMesh(tuple(int(mesh_config.get(a, 1)) for a in sharding.MESH_AXES),
                                   sharding.MESH_AXES)


def shard_factor(spec, mesh):
  """How many pieces a `PartitionSpec` cuts an array into on `mesh` (1 = fully replicated)."""
  factor = 1
  for entry in spec:
    for axis in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
      factor *= mesh.shape[axis]
  return factor


def param_shards(model, mesh_config):
  """Per parameter: (path, count, bytes, shard factor) under `config.mesh` and its rules, the
  placement training gives it (`layers.sharding.param_specs`)."""
  params = nnx.state(model, nnx.Param)
  mesh = abstract_mesh(mesh_config)
  specs = dict(_leaves(sharding.param_specs(params, mesh, sharding.rules_of(mesh_config))))
  out = []
  for path, var in _leaves(params):
    count = math.prod(var.get_value().shape)
    out.append((path, count, count * var.get_value().dtype.itemsize,
                shard_factor(specs[path].get_value(), mesh)))
  return out


def per_device_param_bytes(model, mesh_config):
  """Bytes of parameters on one device: each parameter's bytes over its shard factor (a dimension
  the rules' axis does not divide stays whole, as in `layers.sharding.spec`)."""
  return sum(b // f for _, _, b, f in param_shards(model, mesh_config))


def activation_bytes(cfg, vocab_size, batch_size, length, mesh_config, bytes_per_element=4):
  """Estimate of the activations one training step keeps for the backward pass, per device.

  Per self-attention layer and token (float32, no rematerialisation, every tensor the backward
  reads counted once, whatever XLA fuses): the sublayer input and its norm (2·D), q (N·H), k and v
  (2·K·H), the softmax probabilities (N·S) and the attention output (N·H); per FFN: input and norm
  (2·D) and the hidden activations (2·F: pre- and post-activation; gated 4·F: gate, up, act(gate),
  their product). Cross-attention: as self-attention with S source keys. Plus the logits and their
  log-softmax (2·V per output token). On the mesh: rows over data x fsdp x expert, the length over
  sequence, heads, F and V over tensor (the D-wide residual tensors are replicated over tensor).

  Returns:
    bytes per device.
  """
  stacks, cross = stack_layout(cfg.arch)
  mesh = abstract_mesh(mesh_config)
  rows = mesh.shape['data'] * mesh.shape['fsdp'] * mesh.shape['expert']
  b = -(-batch_size // rows)
  t = -(-length // mesh.shape['sequence'])
  tp = mesh.shape['tensor']
  d, n, k, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.d_ff
  h = d // n

  def split(x, dim):  # a tensor-parallel dimension, split only where tensor divides it
    return x / tp if dim % tp == 0 else x

  def attn(s):
    return 2 * d + split(2 * n * h + n * s, n) + split(2 * k * h, k)

  ffn = 2 * d + split((4 if cfg.ffn in GATED_FFNS else 2) * f, f)
  per_token = (attn(length) + ffn) * cfg.num_layers * stacks
  if cross:
    per_token += attn(length) * cfg.num_layers
  per_token += split(2 * vocab_size, vocab_size)
  return int(b * t * per_token * bytes_per_element)


def training_bytes(cfg, vocab_size, batch_size, length, mesh_config, accum_steps=1):
  """Estimate of the memory one training step needs per device (float32 state, no remat).

  The state is the parameters, their gradients and AdamW's two moments: 4 x the per-device
  parameter bytes (`per_device_param_bytes`); the activations are those of one micro-batch
  (`activation_bytes`; Transformer archs only, 0 for the RNN). XLA's temporaries are not counted,
  so the step needs at least this much: a run whose estimate exceeds the device cannot fit.

  Args:
    cfg: a resolved `config.model`.
    vocab_size: V.
    batch_size: the global batch (`train.batch_size`).
    length: the training length (`data.max_length`).
    mesh_config: `config.mesh` (the per-device share of parameters and rows).
    accum_steps: `train.grad_accum_steps` (rows in memory at a time: batch_size / accum_steps).

  Returns:
    {'state', 'activations', 'total'} bytes per device.
  """
  state = 4 * per_device_param_bytes(abstract_model(cfg, vocab_size, length), mesh_config)
  activations = 0
  if covers(cfg.arch):
    activations = activation_bytes(cfg, vocab_size, -(-batch_size // accum_steps), length,
                                   mesh_config)
  return {'state': state, 'activations': activations, 'total': state + activations}


# --- Training compute -----------------------------------------------------------------------------

def training_flops_per_token(cfg, vocab_size, length):
  """Training FLOPs per token of a resolved `config.model`: 3 x the forward's (the backward costs
  twice the forward, the usual convention: one matmul for the activations' gradient and one for
  the weights').

  The forward is counted in closed form from the variant's own parameters, not from the dense
  layer's: 2 FLOPs per weight a token passes through (`formula_params`' self- and
  cross-attention, each layer's variant as it declares its `param_count`, so MLA's low-rank
  projections and Gated DeltaNet's gates count as built; the FFN as `ffn_layers_params(active=
  True)`, an MoE block's router, shared and k routed experts only), plus the D x V output
  projection, plus the causal score pairs of `forward_flops` averaged over the row. Chosen over
  XLA's cost analysis of the lowered program because a sweep expands every cell before the first
  one runs and the closed form costs microseconds there; its limits: a linear or sparse variant's
  scores count as the dense causal ones (its recurrence's own O(T·D·H) is left out), and
  elementwise work (norms, softmax, activations) is not counted. A dense decoder reads 6N +
  6·(causal pairs per token)·2·D·L, the 6N + attention of Kaplan et al. (2020).

  Args:
    cfg: a resolved `config.model` of a Transformer arch (`covers`).
    vocab_size: V.
    length: the training row's length T (`data.max_length`).

  Returns:
    FLOPs per training token (a float).
  """
  stacks, _ = stack_layout(cfg.arch)
  parts = formula_params(cfg, vocab_size, length)
  weights = (parts['attention'] + parts['cross_attention']
             + ffn_layers_params(cfg, active=True) * stacks + cfg.d_model * vocab_size)
  scores = forward_flops(cfg, vocab_size, length)['scores_causal'] / length
  return 3.0 * (2 * weights + scores)
