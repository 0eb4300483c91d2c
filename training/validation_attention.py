"""What attention, its kernel and the position method can do together, derived from declarations.

Every rule here reads a declaration: the kernel's row in `layers.attention.KERNELS`
(`layers.contract.Kernel`: the score terms it takes, dropout, the sequence mesh, platforms), the
variant's class attributes (`uses_kernel`, `takes_score_terms`, `cached_decoding`, ...) and the
position method's `terms_for`. No position, kernel or variant is named here, so a new one is
checked as soon as it declares what it does.
"""

import models
from layers import attention
from layers import attention_variants
from layers import contract
from layers.options import ConfigError
from layers import positions
from models import stack


def variant_label(model_cfg, name, role='decoder'):
  """How a message names the self-attention variant `name` of stack `role` (the roles of
  `models.contract.ArchSpec.stacks`): "model.attention='x'", "model.decoder_attention='x'" or
  "model.layer_pattern entry 'x'"."""
  m = model_cfg
  if stack.pattern_entries(m):
    return f'model.layer_pattern entry {name!r}'
  if (role == 'decoder' and 'decoder_attention' in models.spec(m.arch).options
      and m.get('decoder_attention', '')):
    return f'model.decoder_attention={name!r}'
  return f'model.attention={name!r}'


def self_attentions(model_cfg, roles=None):
  """[(label, class)] of each distinct self-attention variant of the stacks in `roles` (None:
  every stack), each layer's own under `model.layer_pattern` (models.layer_attentions)."""
  out = {}
  for role, names in models.layer_attentions(model_cfg).items():
    if roles is None or role in roles:
      for name in names:
        out.setdefault(variant_label(model_cfg, name, role), attention_variants.VARIANTS[name])
  return list(out.items())


def attention_layers(model_cfg):
  """[(label, class, takes the position)] for every attention the model builds: each distinct
  self-attention variant of its stacks (the position acts there) and the decoder's
  cross-attention (it does not)."""
  layers = [(label, cls, True) for label, cls in self_attentions(model_cfg)]
  if models.spec(model_cfg.arch).cross_attention:
    layers.append(('cross-attention', attention.Attention, False))
  return layers


def decoder_layers(model_cfg):
  """[(label, class)] of the self-attention variants that decode token by token: the stack the
  arch declares as its `decoder` ([]: none)."""
  decoder = models.spec(model_cfg.arch).decoder
  return self_attentions(model_cfg, roles=(decoder,)) if decoder else []


def decodes_with_cache(model_cfg):
  """Whether the model has a decoder and every one of its layers a cached step."""
  layers = decoder_layers(model_cfg)
  return bool(layers) and all(cls.cached_decoding is not None for _, cls in layers)


def check_decoding(model_cfg, what):
  """Raises ConfigError if `what` (e.g. '--translate') needs a KV-cache decode a layer of the
  decoder does not declare (`cached_decoding` None): every layer decodes with its own cache."""
  for label, cls in decoder_layers(model_cfg):
    if cls.cached_decoding is not None:
      continue
    valid = [name for name, v in attention_variants.VARIANTS.items()
             if v.cached_decoding is not None and v.supports_causal]
    raise ConfigError(f'{what} decodes with a KV cache, which {label} ({cls.__name__}) does not '
                      f'have; valid values: {", ".join(valid)}')


def _positions_without(terms_allowed, model_cfg):
  """The position methods whose terms under `model_cfg` all lie in `terms_allowed`."""
  return sorted(name for name, p in positions.POSITIONS.items()
                if set(p.terms_for(model_cfg)) <= set(terms_allowed))


def check_position_terms(model_cfg, layers):
  """The position's score terms (`terms_for`) against each self-attention that receives them:
  the variant must take score terms, and the kernel it runs every term."""
  m = model_cfg
  terms = positions.POSITIONS[m.position].terms_for(m)
  if not terms:
    return
  kernel = attention.KERNELS[m.attention_impl]
  for label, cls, takes_position in layers:
    if not takes_position:
      continue
    if not cls.takes_score_terms:
      raise ConfigError(
          f'model.position={m.position!r} adds {contract.TERM_NAMES[terms[0]]} to the scores, '
          f'which {label} does not take; valid values: '
          f'{", ".join(_positions_without((), m))}')
    missing = kernel.missing(terms) if cls.uses_kernel else []
    if missing:
      raise ConfigError(
          f'model.position={m.position!r} adds {contract.TERM_NAMES[missing[0]]}, which '
          f'model.attention_impl={m.attention_impl!r} cannot take; valid values: '
          f'{", ".join(attention.kernels_taking(missing[0]))} (or model.position in: '
          f'{", ".join(_positions_without(kernel.terms, m))})')


def _layer_option(model_cfg, term):
  """`model.<option>=<value>` of a layer term (`attention.LAYER_TERMS`), as a message names it."""
  name = attention.LAYER_TERMS[term]
  return f'model.{name}={model_cfg.get(name)!r}'


def check_layer_terms(model_cfg, layers):
  """The layer's own terms the options turn on (the logit soft cap, the sinks) against each
  attention the model builds: the variant must declare them (`layer_terms`), and the kernel of a
  variant that runs one must take them (`Kernel.terms`)."""
  m = model_cfg
  on = [term for term, name in attention.LAYER_TERMS.items() if m.get(name)]
  if on and not layers:
    raise ConfigError(f'{_layer_option(m, on[0])} is not taken by model.arch={m.arch!r} (no '
                      'Transformer attention); valid value here: off')
  kernel = attention.KERNELS[m.attention_impl]
  variants = attention_variants.VARIANTS
  for term in on:
    for label, cls, _ in layers:
      if term not in cls.layer_terms:
        valid = sorted(name for name, v in variants.items() if term in v.layer_terms)
        raise ConfigError(f'{_layer_option(m, term)} is not taken by {label}; '
                          f'valid values: {", ".join(valid)}')
      if cls.uses_kernel and term not in kernel.terms:
        raise ConfigError(f'{_layer_option(m, term)} is not taken by model.attention_impl='
                          f'{m.attention_impl!r}; valid kernels: '
                          f'{", ".join(attention.kernels_taking(term))}')


def check_kernel(config):
  """`model.attention_impl` against the variants that run it, the position, dropout, the mesh's
  sequence axis and the platform compiled for (this host's, or tools.aot's target)."""
  m = config.model
  impl = m.attention_impl
  kernel = attention.KERNELS[impl]
  layers = attention_layers(m)
  check_position_terms(m, layers)
  check_layer_terms(m, layers)
  users = [cls for _, cls, _ in layers if cls.uses_kernel]
  if not users:
    if impl != attention.DEFAULT_KERNEL:
      labels = ', '.join(label for label, _, _ in layers) or f'model.arch={m.arch!r}'
      raise ConfigError(f'model.attention_impl={impl!r} is not used: {labels} computes its '
                        f'attention its own way; valid value: {attention.DEFAULT_KERNEL!r} (the '
                        'default)')
    return
  rate = m.get('attention_dropout', 0.0)
  if rate > 0 and not kernel.dropout:
    raise ConfigError(f'model.attention_dropout={rate!r} is not implemented by '
                      f'model.attention_impl={impl!r}; valid values with attention dropout: '
                      f'{", ".join(attention.kernels_taking(dropout=True))} (or '
                      'attention_dropout=0)')
  mesh = config.get('mesh', None)
  sequence = mesh.get('sequence', 1) if mesh is not None else 1
  if kernel.sequence_mesh == 'never' and sequence > 1:
    raise ConfigError(f'model.attention_impl={impl!r} holds the whole sequence on each device '
                      f'(shard_map over batch and heads), so mesh.sequence={sequence} would only '
                      'repeat its work; valid: mesh.sequence=1, or model.attention_impl in: '
                      f'{", ".join(_kernels_with_sequence("needed"))} (context parallelism)')
  if kernel.sequence_mesh == 'needed' and sequence < 2:
    raise ConfigError(f'model.attention_impl={impl!r} needs mesh.sequence > 1 (the devices the '
                      'length is split over); valid on one device: '
                      f'{", ".join(_kernels_with_sequence("any"))}')
  platform = attention.target_platform()  # a TPU target's when tools.aot compiles for one
  if platform not in kernel.platforms:
    valid = [k for k, v in attention.KERNELS.items() if platform in v.platforms]
    raise ConfigError(f'model.attention_impl={impl!r} needs {" or ".join(kernel.platforms)}; '
                      f'valid here ({platform}): {", ".join(valid)}')


def _kernels_with_sequence(kind):
  """The kernels whose `sequence_mesh` is `kind`."""
  return [k for k, v in attention.KERNELS.items() if v.sequence_mesh == kind]
