"""Hugging Face `config.json` <-> attnlab `config.model`, per model family.

`to_model(hf)` maps every field attnlab understands and refuses, in one line naming the field, any
it cannot reproduce (an unknown rope type, MoE layers, a sliding window on some layers only).
`to_hf(model)` is the inverse for an attnlab config the family can express, and refuses the rest
(ALiBi into Llama) the same way. Fields that change nothing the model computes (dropouts,
`use_cache`, initializer ranges, token ids) are read where they matter and otherwise left alone.
"""

import math

from layers import initializers
from layers import positions as positions_lib
from models.hf import weights


class HFError(ValueError):
  """A checkpoint or config attnlab cannot convert; the message is one line."""


LLAMA_TYPES = ('llama', 'mistral', 'qwen2', 'qwen3')
MODEL_TYPES = LLAMA_TYPES + ('gpt2',)
# Fields whose presence means layers attnlab does not build (mixtures of experts and the like).
REFUSED_FIELDS = ('num_local_experts', 'num_experts', 'n_routed_experts', 'moe_intermediate_size',
                  'layer_types_moe', 'kv_lora_rank')
ROPE_TYPES = {'default': 'none', 'linear': 'pi', 'dynamic': 'dynamic', 'yarn': 'yarn',
              'llama3': 'llama3'}
GPT2_ACTIVATIONS = {'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu',
                    'relu': 'relu'}
COMMON = dict(arch='decoder_only', attention='dense', attention_impl='xla', norm_position='pre',
              scan_layers=False, dropout=0.0, attention_dropout=0.0, ffn_dropout=0.0,
              embed_scale='plain', output_bias=False, unscaled=False, final_logit_softcap=0.0,
              attn_logit_softcap=0.0, attention_gate='none', attention_sinks=False,
              layer_pattern='', moe_experts=0, use_bias=False, random_positions_max=0)


def model_type(hf):
  """`hf['model_type']`, refused in one line unless it is a family attnlab converts."""
  kind = hf.get('model_type') if isinstance(hf, dict) else None
  if kind not in MODEL_TYPES:
    raise HFError(f'config.json model_type={kind!r} is not a family attnlab converts; valid: '
                  f'{list(MODEL_TYPES)}')
  return kind


# Fields that change nothing the model computes (ids, dropouts at inference, bookkeeping, heads
# other than the LM's), or that the family's mapping below reads.
BENIGN_FIELDS = frozenset((
    'architectures', 'model_type', 'transformers_version', 'torch_dtype', 'dtype', '_name_or_path',
    'bos_token_id', 'eos_token_id', 'pad_token_id', 'sep_token_id', 'decoder_start_token_id',
    'use_cache', 'initializer_range', 'attention_dropout', 'output_attentions',
    'output_hidden_states', 'return_dict', 'id2label', 'label2id', 'problem_type',
    'tokenizer_class', 'task_specific_params', 'torchscript', 'chunk_size_feed_forward',
    'is_decoder', 'is_encoder_decoder', 'prefix', 'finetuning_task', 'use_return_dict',
    'tie_word_embeddings', 'vocab_size', 'quantization_config_applied', 'generation_config'))
MAPPED_FIELDS = {
    'llama': ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads',
              'num_key_value_heads', 'head_dim', 'hidden_act', 'max_position_embeddings',
              'rms_norm_eps', 'rope_theta', 'rope_scaling', 'rope_parameters',
              'partial_rotary_factor', 'attention_bias', 'mlp_bias', 'pretraining_tp'),
    'gpt2': ('n_embd', 'n_layer', 'n_head', 'n_inner', 'n_positions', 'n_ctx',
             'activation_function', 'layer_norm_epsilon', 'scale_attn_weights',
             'scale_attn_by_inverse_layer_idx', 'add_cross_attention', 'reorder_and_upcast_attn',
             'attn_pdrop', 'embd_pdrop', 'resid_pdrop', 'summary_activation',
             'summary_first_dropout', 'summary_proj_to_labels', 'summary_type',
             'summary_use_proj'),
}
MAPPED_FIELDS['mistral'] = MAPPED_FIELDS['llama'] + ('sliding_window',)
MAPPED_FIELDS['qwen2'] = MAPPED_FIELDS['llama'] + ('sliding_window', 'use_sliding_window',
                                                   'max_window_layers', 'layer_types')
MAPPED_FIELDS['qwen3'] = MAPPED_FIELDS['qwen2']


def _refuse_unknown_structure(hf, kind):
  """MoE and latent-attention fields, and any field neither benign nor mapped that is set: a
  conversion that dropped it would compute something else (the classic silent failure)."""
  for field in REFUSED_FIELDS:
    if hf.get(field):
      raise HFError(f'config.json {field}={hf[field]!r}: attnlab imports dense models only '
                    '(no mixture-of-experts or latent-attention layers)')
  known = BENIGN_FIELDS.union(MAPPED_FIELDS[kind])
  for field, value in hf.items():
    if field not in known and value not in (None, False, 0, '', [], {}):
      raise HFError(f'config.json {field}={value!r} is not a field attnlab maps for {kind}; '
                    'importing without it would compute something else')
  types = set(hf.get('layer_types') or ['full_attention'])
  if types != {'full_attention'}:
    raise HFError(f'config.json layer_types={sorted(types)}: only full_attention layers are '
                  'supported (a window on some layers only)')


ROPE_KEYS = frozenset(('rope_type', 'type', 'rope_theta', 'factor',
                       'original_max_position_embeddings', 'low_freq_factor', 'high_freq_factor',
                       'beta_fast', 'beta_slow',
                       'attention_factor', 'mscale', 'mscale_all_dim', 'truncate',
                       'partial_rotary_factor'))


def require(hf, field, kind=(int, float)):
  """`hf[field]`, refused in one line when absent or not of `kind`."""
  value = hf.get(field)
  if isinstance(value, bool) or not isinstance(value, kind):
    raise HFError(f'config.json {field}={value!r}: a number is required')
  return value


def rope_parameters(hf):
  """(rope_type, its parameters, theta) from either form transformers writes: `rope_theta` +
  `rope_scaling` (checkpoints on the Hub) or `rope_parameters` (transformers 5); both present and
  different, an unknown key, or a partial rotary factor (which transformers' Llama family does not
  apply: it rotates the whole head) are refused."""
  scaling, parameters = hf.get('rope_scaling'), hf.get('rope_parameters')
  for name, value in (('rope_scaling', scaling), ('rope_parameters', parameters)):
    if value is not None and not isinstance(value, dict):
      raise HFError(f'config.json {name}={value!r}: a dict or null is required')
  if scaling and parameters and {k: v for k, v in parameters.items() if k != 'rope_theta'} != {
      k: v for k, v in scaling.items() if k != 'rope_theta'}:
    raise HFError('config.json has both rope_scaling and rope_parameters, and they differ; '
                  'valid: one of them')
  params = dict(parameters or scaling or {})
  unknown = sorted(set(params) - ROPE_KEYS)
  if unknown:
    raise HFError(f'config.json rope key {unknown[0]!r} is not supported (per-layer rope '
                  f'parameters?); valid: {sorted(ROPE_KEYS)}')
  fraction = params.get('partial_rotary_factor', hf.get('partial_rotary_factor', 1.0))
  if fraction not in (None, 1, 1.0):
    raise HFError(f'config.json partial_rotary_factor={fraction!r}: transformers\' Llama family '
                  'rotates the whole head whatever it says; valid: 1.0')
  theta = params.get('rope_theta', hf.get('rope_theta', 10000.0))
  kind = params.get('rope_type', params.get('type', 'default'))
  return kind, params, float(theta)


def _rope_fields(hf, kind, params):
  """The model.rope_* fields of a rope type (ROPE_TYPES) and its parameters."""
  if kind not in ROPE_TYPES:
    raise HFError(f'config.json rope type {kind!r} is not supported; valid: {list(ROPE_TYPES)}')
  max_pos = int(require(hf, 'max_position_embeddings', int))
  # The pretrained context L, kept whatever the scaling: a fine-tune at a longer data.max_length
  # that turns a scaling on refers to it (YaRN's ramp, llama3's bands, dynamic NTK's threshold).
  fields = {'rope_scaling': ROPE_TYPES[kind], 'rope_original_length': max_pos}
  if kind == 'default':
    return fields
  original = int(params.get('original_max_position_embeddings') or max_pos)
  factor = params.get('factor')
  if factor is None and kind == 'yarn':
    factor = max_pos / original  # transformers' rule when only the two lengths are given
  fields['rope_scaling_factor'] = float(require({'factor': factor}, 'factor'))
  if kind != 'dynamic':  # dynamic NTK scales past max_position_embeddings itself
    fields['rope_original_length'] = original
  if kind == 'llama3':
    fields.update(rope_low_freq_factor=float(require(params, 'low_freq_factor')),
                  rope_high_freq_factor=float(require(params, 'high_freq_factor')))
  if kind == 'yarn':
    if params.get('truncate') is False:
      raise HFError('config.json rope yarn truncate=False is not supported; valid: true')
    fields.update(rope_yarn_beta_fast=float(params.get('beta_fast') or 32.0),
                  rope_yarn_beta_slow=float(params.get('beta_slow') or 1.0),
                  rope_attention_factor=_yarn_attention_factor(params, float(factor)))
  return fields


def _yarn_mscale(scale, mscale=1.0):
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(params, factor):
  """transformers' yarn `attention_factor`: given, or from mscale/mscale_all_dim, else 0 (attnlab's
  default, 0.1 ln(s) + 1)."""
  if params.get('attention_factor') is not None:
    return float(params['attention_factor'])
  if params.get('mscale') and params.get('mscale_all_dim'):
    return _yarn_mscale(factor, params['mscale']) / _yarn_mscale(factor, params['mscale_all_dim'])
  return 0.0


def _head_dim(hf, heads):
  """model.head_dim: the checkpoint's where it differs from D / N (Qwen3), else 0 (the default,
  which every attention variant reads)."""
  given = int(hf.get('head_dim') or 0)
  return given if given and given != int(require(hf, 'hidden_size', int)) // heads else 0


def _llama_model(hf, kind):
  """Llama, Mistral, Qwen2, Qwen3 -> model fields."""
  if hf.get('hidden_act', 'silu') != 'silu':
    raise HFError(f'config.json hidden_act={hf["hidden_act"]!r} is not supported for {kind}; '
                  'valid: silu')
  if hf.get('pretraining_tp', 1) != 1:
    raise HFError(f'config.json pretraining_tp={hf["pretraining_tp"]!r}; valid: 1')
  heads = require(hf, 'num_attention_heads', int)
  fields = dict(COMMON, num_layers=require(hf, 'num_hidden_layers', int),
                d_model=require(hf, 'hidden_size', int),
                num_heads=heads, num_kv_heads=int(hf.get('num_key_value_heads') or heads),
                d_ff=require(hf, 'intermediate_size', int),
                head_dim=_head_dim(hf, heads),
                norm='rmsnorm', norm_eps=float(hf.get('rms_norm_eps', 1e-6)), ffn='swiglu',
                position='rope', tie_output=bool(hf.get('tie_word_embeddings', False)),
                qk_norm='rmsnorm' if kind == 'qwen3' else 'none',
                attention_bias=bool(hf.get('attention_bias', False)) or kind == 'qwen2',
                attention_out_bias=kind != 'qwen2', ffn_bias=bool(hf.get('mlp_bias', False)))
  rope_kind, params, theta = rope_parameters(hf)
  fields.update(rope_base=theta, rope_fraction=1.0, **_rope_fields(hf, rope_kind, params))
  if kind in ('qwen2', 'qwen3') and hf.get('use_sliding_window'):
    raise HFError(f'config.json use_sliding_window=true ({kind}: a window on some layers only) '
                  'is not supported; valid: false')
  # Mistral's class default is a window of 4096 when the key is absent; null means none.
  window = hf.get('sliding_window', 4096) if kind == 'mistral' else None
  if window:
    # transformers' window of W keys (j > i - W) is attnlab's w = W - 1 (i - w <= j <= i).
    fields.update(attention='sliding_window', window=int(window) - 1)
  return fields


def _gpt2_model(hf):
  for field, valid in (('scale_attn_weights', True), ('scale_attn_by_inverse_layer_idx', False),
                       ('add_cross_attention', False)):
    if hf.get(field, valid) != valid:
      raise HFError(f'config.json {field}={hf[field]!r} is not supported; valid: '
                    f'{str(valid).lower()}')
  act = hf.get('activation_function', 'gelu_new')
  if act not in GPT2_ACTIVATIONS:
    raise HFError(f'config.json activation_function={act!r} is not supported; valid: '
                  f'{list(GPT2_ACTIVATIONS)}')
  d, heads = require(hf, 'n_embd', int), require(hf, 'n_head', int)
  return dict(COMMON, num_layers=require(hf, 'n_layer', int), d_model=d, num_heads=heads,
              num_kv_heads=heads, d_ff=int(hf.get('n_inner') or 4 * d), head_dim=0,
              norm='layernorm', norm_eps=float(hf.get('layer_norm_epsilon', 1e-5)),
              ffn=GPT2_ACTIVATIONS[act], position='learned',
              max_positions=require(hf, 'n_positions', int), attention_bias=True,
              attention_out_bias=True, ffn_bias=True,
              tie_output=bool(hf.get('tie_word_embeddings', True)), qk_norm='none')


def to_model(hf):
  """The `config.model` fields (a dict) of the HF config dict `hf`, and the context length."""
  if not isinstance(hf, dict):
    raise HFError('config.json is not a JSON object')
  kind = model_type(hf)
  _refuse_unknown_structure(hf, kind)
  fields = _gpt2_model(hf) if kind == 'gpt2' else _llama_model(hf, kind)
  fields['vocab_size'] = require(hf, 'vocab_size', int)
  length = require(hf, 'n_positions' if kind == 'gpt2' else 'max_position_embeddings', int)
  return fields, length


ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
                 'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
                 'gpt2': 'GPT2LMHeadModel'}
# What every exported model must be: (field, the value every family needs).
EXPORT_REQUIRED = (('arch', 'decoder_only'), ('norm_position', 'pre'), ('layer_pattern', ''),
                   ('moe_experts', 0), ('attention_gate', 'none'), ('attention_sinks', False),
                   ('attn_logit_softcap', 0.0), ('final_logit_softcap', 0.0), ('unscaled', False),
                   ('embed_scale', 'plain'), ('scan_layers', False), ('random_positions_max', 0),
                   ('output_bias', False))
# Per family: (field, the values it can express).
EXPORT_FAMILY = {
    'llama': (('position', ('rope',)), ('norm', ('rmsnorm',)), ('ffn', ('swiglu',)),
              ('attention', ('dense',)), ('qk_norm', ('none',)),
              ('rope_scaling', ('none', 'pi', 'dynamic', 'yarn', 'llama3')),
              ('rope_fraction', (1.0,))),
    'gpt2': (('position', ('learned',)), ('norm', ('layernorm',)),
             ('ffn', tuple(GPT2_ACTIVATIONS.values())), ('attention', ('dense',)),
             ('qk_norm', ('none',)), ('attention_bias', (True,)), ('attention_out_bias', (True,)),
             ('ffn_bias', (True,))),
}
EXPORT_FAMILY['mistral'] = EXPORT_FAMILY['llama'][:3] + (
    ('attention', ('dense', 'sliding_window')), ('qk_norm', ('none',)),
    ('attention_bias', (False,)), ('ffn_bias', (False,))) + EXPORT_FAMILY['llama'][5:]
EXPORT_FAMILY['qwen2'] = EXPORT_FAMILY['llama'] + (
    ('attention_bias', (True,)), ('attention_out_bias', (False,)), ('ffn_bias', (False,)))
EXPORT_FAMILY['qwen3'] = EXPORT_FAMILY['llama'][:4] + (('qk_norm', ('rmsnorm',)),) + (
    EXPORT_FAMILY['llama'][5:] + (('ffn_bias', (False,)),))


def _value(m, field):
  if field in ('attention_bias', 'ffn_bias'):
    return getattr(initializers, field)(m)
  return m.get(field)


def family_of(m):
  """The family an attnlab `config.model` reads as: GPT-2 (learned positions), else Qwen3 (QK-norm),
  Qwen2 (q/k/v biases only), Mistral (a sliding window), else Llama."""
  if m.get('position') == 'learned':
    return 'gpt2'
  if m.get('qk_norm', 'none') != 'none':
    return 'qwen3'
  if initializers.attention_bias(m) and not m.get('attention_out_bias', True):
    return 'qwen2'
  return 'mistral' if m.get('attention') == 'sliding_window' else 'llama'


def check_exportable(m, kind):
  """Refuses, in one line naming the field, a `config.model` family `kind` cannot express."""
  if kind not in MODEL_TYPES:
    raise HFError(f'--model_type={kind!r} unknown; valid: {list(MODEL_TYPES)}')
  for field, value in EXPORT_REQUIRED:
    if m.get(field, value) != value:
      raise HFError(f'cannot export model.{field}={m.get(field)!r}: no Hugging Face family '
                    f'computes it; valid: {value!r}')
  for field, valid in EXPORT_FAMILY[kind]:
    if _value(m, field) not in valid:
      raise HFError(f'cannot export model.{field}={_value(m, field)!r} as {kind}; valid: '
                    f'{list(valid)}')
  if kind != 'gpt2' and initializers.attention_bias(m) and not m.get('attention_out_bias', True):
    if kind != 'qwen2':
      raise HFError(f'cannot export model.attention_out_bias=False as {kind} (biases on q/k/v '
                    'only); valid: qwen2, or attention_out_bias=True')
  if kind == 'gpt2' and (m.num_kv_heads != m.num_heads
                         or initializers.head_dim(m) * m.num_heads != m.d_model):
    raise HFError('cannot export as gpt2: model.num_kv_heads and model.head_dim must be the '
                  'defaults (num_heads, d_model / num_heads)')


def _rope_scaling_hf(m):
  """transformers' `rope_scaling` dict of `config.model`'s scaling, or None."""
  kind = m.rope_scaling
  if kind == 'none':
    return None
  back = {ours: theirs for theirs, ours in ROPE_TYPES.items()}
  # 'type' beside 'rope_type': transformers before 4.42 reads the former.
  out = {'rope_type': back[kind], 'type': back[kind], 'factor': float(m.rope_scaling_factor)}
  if kind in ('pi', 'yarn', 'llama3'):
    # linear ignores it in transformers; written so that an import gets the pretrained L back
    out['original_max_position_embeddings'] = int(m.rope_original_length)
  if kind == 'llama3':
    out.update(low_freq_factor=float(m.rope_low_freq_factor),
               high_freq_factor=float(m.rope_high_freq_factor))
  if kind == 'yarn':
    out.update(beta_fast=float(m.rope_yarn_beta_fast), beta_slow=float(m.rope_yarn_beta_slow))
    if m.rope_attention_factor:
      out['attention_factor'] = float(m.rope_attention_factor)
  return out


def to_hf(m, kind, length, vocab_size, token_ids=None):
  """The `config.json` dict of family `kind` for the resolved `config.model` `m` (checked with
  `check_exportable` first); `length` is max_position_embeddings (n_positions for GPT-2)."""
  check_exportable(m, kind)
  ids = {f'{k}_token_id': v for k, v in (token_ids or {}).items() if v is not None}
  common = dict(architectures=[ARCHITECTURES[kind]], model_type=kind, vocab_size=vocab_size,
                tie_word_embeddings=bool(m.tie_output), torch_dtype='float32', **ids)
  if kind == 'gpt2':
    act = {ours: theirs for theirs, ours in reversed(GPT2_ACTIVATIONS.items())}[m.ffn]
    return dict(common, n_positions=int(m.max_positions), n_embd=m.d_model, n_layer=m.num_layers,
                n_head=m.num_heads, n_inner=m.d_ff, activation_function=act,
                layer_norm_epsilon=float(m.norm_eps), scale_attn_weights=True)
  out = dict(common, hidden_size=m.d_model, intermediate_size=m.d_ff,
             num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
             num_key_value_heads=m.num_kv_heads, head_dim=initializers.head_dim(m),
             hidden_act='silu', max_position_embeddings=int(length),
             rms_norm_eps=float(m.norm_eps), rope_theta=float(m.rope_base),
             rope_scaling=_rope_scaling_hf(m))
  if kind in ('llama', 'qwen3'):
    out['attention_bias'] = initializers.attention_bias(m)
  if kind == 'llama':
    out['mlp_bias'] = initializers.ffn_bias(m)
  if kind == 'mistral':
    out['sliding_window'] = m.window + 1 if m.attention == 'sliding_window' else None
  if kind in ('qwen2', 'qwen3'):
    out['use_sliding_window'] = False
  return out


def resolved_model(config):
  """`config.model` with the sizes the tensor list and export read filled in (H, the learned
  table, RoPE's pretrained context L)."""
  m = config.model.copy_and_resolve_references()
  m.head_dim = initializers.head_dim(m)
  m.rope_original_length = m.get('rope_original_length', 0) or config.data.max_length
  if m.position == 'learned':
    m.max_positions = positions_lib.POSITIONS['learned'].max_positions(m, config.data.max_length)
  return m


def tensor_list(m):
  """The checkpoint tensors (models.hf.weights.Tensor) of a resolved `config.model`."""
  return weights.gpt2_tensors(m) if m.position == 'learned' else weights.llama_tensors(m)


IGNORED_SUFFIXES = weights.IGNORED_SUFFIXES


def check_convertible(m):
  """Refuses, in one line, an architecture the families do not have (only decoder-only models)."""
  if m.get('arch') != 'decoder_only':
    raise HFError(f'model.arch={m.get("arch")!r} cannot be converted; valid: decoder_only')


def context_length(config, m):
  """max_position_embeddings to write for the resolved `m`: GPT-2's table; the pretrained context
  L under no scaling and dynamic NTK (which scales past it); L x factor under yarn, exactly
  (transformers 4.4x-4.5x take yarn's factor as max_position_embeddings / L when L is given, so
  anything else would change it there); at least the run's length under pi and llama3."""
  if m.position == 'learned':
    return int(m.max_positions)
  original = int(m.get('rope_original_length', 0) or config.data.max_length)
  if m.rope_scaling in ('none', 'dynamic'):
    return original
  scaled = original * m.rope_scaling_factor
  if m.rope_scaling == 'yarn':
    if scaled != int(scaled):
      raise HFError(f'cannot export yarn with rope_original_length={original} x '
                    f'rope_scaling_factor={m.rope_scaling_factor}: transformers needs '
                    'max_position_embeddings = their product, a whole number')
    return int(scaled)
  return max(int(config.data.max_length), round(scaled))
