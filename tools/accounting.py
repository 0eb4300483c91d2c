"""Prints the parameters, FLOPs and memory of a config as markdown tables.

    python -m tools.accounting --config=configs/decoder_only.py [--config.FIELD=VALUE ...]
        [--vocab_size=V]

The numbers come from `models.accounting` (parameters counted on `jax.eval_shape` of
`models.build` and checked against the closed forms; FLOPs, KV cache, score memory and the memory
per device under `config.mesh`). Exits 2 with one `config error:` line on an invalid config or an
arch the closed forms do not cover.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from data import passkey
from data import synthetic
from data import text_corpus
from data import tokenizer as tokenizer_lib
from data import toy_translation
from layers import attention as attention_lib
from layers import attention_variants
from layers import initializers
from layers import moe
from layers import positions as positions_lib
from layers import sharding
import models
from models import accounting
from training import state as state_lib
from training import validation


def toy_tokenizer():
  """The toy translation task's tokenizer, without generating the data."""
  return tokenizer_lib.Tokenizer.from_words(toy_translation.vocabulary())


def toy_vocab_size():
  """V of the toy translation task (its tokenizer's vocabulary), without generating the data."""
  return toy_tokenizer().vocab_size


def task_vocab_size(data_config):
  """V of the configured task's tokenizer, without preparing data: the toy vocabulary, the
  passkey or synthetic task's words, or for text_pairs / text_lm / python_code the SentencePiece
  vocabulary data.vocab_size and data.shared_vocab give; with data.tokenizer that tokenizer's."""
  task = data_config.get('task', 'base')
  fields = text_corpus.tokenizer_fields(data_config)
  if fields['tokenizer']:  # a Hugging Face tokenizer: read, nothing prepared
    return text_corpus.load_hf_tokenizer(fields['tokenizer']).vocab_size
  if task == 'python_code':  # one SentencePiece model
    return data_config.get('vocab_size', 1000)
  if task in synthetic.TASKS:
    words = synthetic.vocabulary(synthetic.spec_from_config(data_config))
    return tokenizer_lib.Tokenizer.from_words(words).vocab_size
  if task == passkey.TASK:
    return tokenizer_lib.Tokenizer.from_words(passkey.vocabulary()).vocab_size
  if data_config.get('task', 'base') in text_corpus.TASKS:
    return text_corpus.tokenizer_vocab_size(text_corpus.spec_from_config(data_config))
  return toy_vocab_size()


def _n(x):
  return f'{int(round(x)):,}'


def human_bytes(x):
  """Bytes in the largest binary unit that keeps the number >= 1."""
  for unit, size in (('GiB', 2 ** 30), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
    if x >= size:
      return f'{x / size:,.2f} {unit}'
  return f'{int(x)} B'


def _table(header, rows):
  lines = ['| ' + ' | '.join(header) + ' |', '|' + '|'.join('---' for _ in header) + '|']
  return lines + ['| ' + ' | '.join(str(c) for c in r) + ' |' for r in rows]


def report(config, vocab_size):
  """The accounting of a resolved, validated config as markdown text.

  Args:
    config: the whole config (`model`, `data.max_length`, `train.batch_size`, `mesh`), resolved.
    vocab_size: V (`task_vocab_size(config.data)` for the configured task).

  Returns:
    The tables, one string.

  Raises:
    ValueError: a non-Transformer arch.
    RuntimeError: counted parameters that disagree with the closed form (a bug here or there).
  """
  m, length = config.model, config.data.max_length
  model = accounting.abstract_model(m, vocab_size, length)
  counted = accounting.counted_params(model)
  formula = accounting.formula_params(m, vocab_size, length)
  if counted != formula:  # an 'other' component (a parameter no rule names) also lands here
    raise RuntimeError(f'counted parameters {counted} disagree with the closed form {formula}')
  out = _heading(m, vocab_size, length)
  out += _parameters(m, counted, vocab_size, length)
  out += _flops(m, vocab_size, length, config.train.batch_size)
  out += _kv_cache(m, length)
  out += _scores(m, length)
  out += _per_device(config, model, vocab_size, sum(counted.values()))
  return '\n'.join(out)


def _variants(m):
  """The self-attention variants of every layer of every stack (models.layer_attentions)."""
  return {name for names in models.layer_attentions(m).values() for name in names}


def _heading(m, vocab_size, length):
  h = m.d_model // m.num_heads
  pattern = m.get('layer_pattern', '')
  attention = f'layer_pattern={pattern}' if pattern else f'attention={m.attention}'
  return [f'# Accounting: arch={m.arch}, L={m.num_layers} per stack, D={m.d_model}, '
          f'N={m.num_heads}, K={m.num_kv_heads}, H={h}, F={m.d_ff}, V={vocab_size}, T={length}, '
          f'ffn={m.ffn}, norm={m.norm}, position={m.position}, {attention}, '
          f'use_bias={m.use_bias}']


def _parameters(m, counted, vocab_size, length):
  """The parameter table: each component counted, per layer, and its closed form."""
  stacks, cross = accounting.stack_layout(m.arch)
  layers = m.num_layers * stacks
  layer = (counted['attention'] + counted['ffn']) / layers  # self-attention + FFN
  biases = ' + biases' if m.use_bias else ''
  attn_form = attention_variants.VARIANTS[m.attention].param_form or (
      '4·D²' if m.num_kv_heads == m.num_heads else '2·D² + 2·D·K·H')
  shared = stacks == 1 or m.get('share_embeddings', True)
  extra = ''.join(dict.fromkeys(attention_variants.VARIANTS[name].param_form_extra
                                for name in sorted(_variants(m))))
  gate = {'headwise': ' + D·N (gate)', 'elementwise': ' + D·N·H (gate)'}.get(
      m.get('attention_gate', 'none'), '')
  gate += ' + 2·H (QK-norm)' if m.get('qk_norm', 'none') == 'rmsnorm' else ''
  rows = [
      ('embedding', '', '', _n(counted['embedding']),
       'V·D' + ('' if shared else ' x2 (not shared)')),
      ('positions', '', '', _n(counted['positions']),
       positions_lib.POSITIONS[m.position].param_form),
      ('attention', _n(counted['attention'] / layers), layers, _n(counted['attention']),
       attn_form + biases + extra + gate),
  ]
  per_layer = _n(layer)
  if cross:
    cross_layer = counted['cross_attention'] / m.num_layers
    rows.append(('cross-attention', _n(cross_layer), m.num_layers,
                 _n(counted['cross_attention']), attn_form + biases + gate))
    per_layer = f'enc {_n(layer)}, dec {_n(layer + cross_layer)}'
  rows += _ffn_rows(m, counted['ffn'], stacks, biases)
  rows += [
      ('norms', '', '', _n(counted['norms']),
       ('2·D' if m.norm == 'layernorm' else 'D') + ' per norm'),
      ('output', '', '', '0', 'tied to the embedding'),
      ('**total**', per_layer, layers, f'**{_n(sum(counted.values()))}**', ''),
  ]
  ffn_share = 100 * counted['ffn'] / layers / layer
  out = (['', '## Parameters (counted on jax.eval_shape of models.build = closed form)', '']
         + _table(('component', 'per layer', 'layers', 'total', 'closed form'), rows)
         + ['', f'A layer (self-attention + FFN) holds {_n(layer)} = '
            f'{layer / m.d_model ** 2:.2f}·D² parameters on average, {ffn_share:.1f}% of them in '
            'the FFN.'])
  if moe.num_moe_layers(m):
    total = sum(counted.values())
    active = accounting.active_params(m, vocab_size, length)
    out += ['', f'Mixture of experts: **{_n(total)} parameters in total, {_n(active)} active** '
            f'per token ({100 * active / total:.1f}%): each MoE block\'s router, its '
            f'{m.get("moe_shared_experts", 0)} shared expert(s) and k = {m.moe_top_k} of its '
            f'E = {m.moe_experts} routed experts.']
  return out


def _ffn_rows(m, ffn_total, stacks, biases):
  """The feed-forward rows: one for a dense model; for MoE the dense blocks (if any), the router,
  the routed experts and the shared experts, each with its closed form in E, k and F_e."""
  mats = '3' if m.ffn in accounting.GATED_FFNS else '2'
  num_moe = moe.num_moe_layers(m)
  if not num_moe:
    layers = m.num_layers * stacks
    return [('FFN', _n(ffn_total / layers), layers, _n(ffn_total), f'{mats}·D·F' + biases)]
  layer = accounting.moe_layer_params(m)
  dense = m.num_layers - num_moe
  moe_layers = num_moe * stacks
  rows = []
  if dense:
    per = accounting.ffn_params(m.d_model, m.d_ff, m.ffn,
                                use_bias=initializers.ffn_bias(m))
    rows.append(('FFN (dense blocks)', _n(per), dense * stacks, _n(per * dense * stacks),
                 f'{mats}·D·F' + biases))
  width = f'F_e = {moe.expert_width(m)}'
  rows += [('MoE router', _n(layer['router']), moe_layers, _n(layer['router'] * moe_layers),
            f'D·E (E = {m.moe_experts})'),
           ('MoE routed experts', _n(layer['experts']), moe_layers,
            _n(layer['experts'] * moe_layers), f'E·{mats}·D·F_e ({width}; a token uses k = '
            f'{m.moe_top_k})')]
  if layer['shared']:
    rows.append(('MoE shared experts', _n(layer['shared']), moe_layers,
                 _n(layer['shared'] * moe_layers),
                 f'S·{mats}·D·F_e (S = {m.moe_shared_experts})'))
  return rows


def _flops(m, vocab_size, length, batch_size):
  """FLOPs per token, inference and training, with the full and the kept attention scores."""
  fl = accounting.forward_flops(m, vocab_size, length)
  fwd_full = fl['matmul'] + fl['scores']
  fwd_causal = fl['matmul'] + fl['scores_causal']

  def row(label, flops):  # per token: forward, and training = 3 x forward
    return (label, _n(flops / length), _n(3 * flops / length))

  rows = [row('matmuls (2 x weights touched, incl. D x V output)', fl['matmul']),
          row('attention scores, full T x S (as the xla kernel computes them)', fl['scores']),
          row('attention scores, only the pairs the mask keeps (causal: about half)',
              fl['scores_causal']),
          row('**total** (full scores)', fwd_full),
          row('total (kept pairs only)', fwd_causal)]
  out = ['', f'## FLOPs per token (T={length}; per row / T; training = 3 x forward: the backward '
         'pass costs two matmuls per forward matmul)', '']
  out += _table(('', 'inference (forward)', 'training'), rows)
  out += ['', f'Per step (batch {batch_size} x {length} tokens): '
          f'{3 * fwd_full * batch_size:,.3g} training FLOPs.']
  if moe.num_moe_layers(m):
    out.append(f'MoE blocks count what a token passes through: the router, the shared experts '
               f'and k = {m.moe_top_k} of the E = {m.moe_experts} experts (capacity padding and '
               'dropped tokens aside).')
  # The plain layer's scores are the exact dense ones counted here; every variant its own.
  others = sorted(n for n in _variants(m)
                  if attention_variants.VARIANTS[n] is not attention_lib.Attention)
  if others:
    out.append(f'Scores are counted as exact dense attention in every layer; '
               f'the {", ".join(others)} layers compute their own pattern, so their score '
               'FLOPs differ.')
  return out


def _kv_cache(m, length):
  """The KV cache of this config (none without a decoding stack), per token against MHA, GQA and
  MQA of the same width, and the textbook example."""
  _, cross = accounting.stack_layout(m.arch)
  decodes = models.spec(m.arch).decoder is not None
  h = m.d_model // m.num_heads

  def row(label, elems):
    return (label, _n(elems), human_bytes(4 * elems), human_bytes(2 * elems))

  out = ['', '## KV cache (layers x what a layer caches per token x length x bytes)', '']
  rows = []
  if not decodes:
    out += [f'{m.arch}: no decoding stack, no autoregressive decoding, no KV cache.']
  else:
    elems = accounting.kv_cache_per_token(m) * length
    if cross:
      # the cross-attention keys/values of the source (length T), cached once
      elems += accounting.kv_cache_elements(m.num_layers, m.num_kv_heads, h, length)
    label = f'this config, one sequence of {length}' + (' (self + cross)' if cross else '')
    rows.append(row(label, elems))
    if m.get('layer_pattern', ''):
      out += [f'Every layer counted as keeping keys and values; under model.layer_pattern='
              f'{m.layer_pattern} only the dense-cache layers do (the recurrent ones keep a '
              'fixed-size state, a window its last w keys at most).', '']
  for name, kv in (('MHA', 32), ('GQA, 8 KV heads', 8), ('MQA', 1)):
    elems = accounting.kv_cache_elements(32, kv, 64, 2048)
    rows.append(row(f'example: 32 layers, 32 heads, H 64, length 2048, {name}', elems))
  out += _table(('', 'elements', 'fp32', 'fp16/bf16'), rows)
  out += ['', 'The example is 2 x 32 layers x 32 heads x 64 x 2048 = 268,435,456 elements (the '
          '"268 MB" some texts print is that element count, not bytes); 8 KV heads keep a quarter '
          'of it, one KV head a 32nd.']
  if decodes:
    out += _cache_per_token(m, h)
  return out


def _cache_per_token(m, h):
  """Self-attention cache per token and layer: this config's variant (its `cache_per_token`)
  against MHA, GQA and MQA of the same D, N and H."""
  def row(label, form, elems):
    return (label, form, _n(elems), human_bytes(4 * elems * m.num_layers),
            human_bytes(2 * elems * m.num_layers))

  own = accounting.kv_cache_per_token(m) // m.num_layers
  spec = models.spec(m.arch)
  attention = spec.stack(spec.decoder).config(m).attention  # the decoding stack's variant
  form = attention_variants.VARIANTS[attention].cache_form
  rows = [row(f'this config (attention={attention}, K={m.num_kv_heads})', form, own),
          row(f'MHA (K = N = {m.num_heads})', '2·N·H', 2 * m.num_heads * h)]
  if 1 < m.num_kv_heads < m.num_heads:
    rows.append(row(f'GQA (K = {m.num_kv_heads})', '2·K·H', 2 * m.num_kv_heads * h))
  rows.append(row('MQA (K = 1)', '2·H', 2 * h))
  return (['', f'Per token and layer, against the dense forms of the same width (D={m.d_model}, '
           f'N={m.num_heads}, H={h}; bytes over the {m.num_layers} layers):', '']
          + _table(('self-attention', 'closed form', 'elements per layer', 'fp32, all layers',
                    'fp16/bf16, all layers'), rows))


def _scores(m, length):
  """The memory of the attention scores: one head and one layer of this config, and T = 8192."""
  def row(label, length, heads=1):  # fp32, fp16, fp16 with the softmax output kept
    return (label, human_bytes(heads * accounting.score_bytes(length, 4)),
            human_bytes(heads * accounting.score_bytes(length, 2)),
            human_bytes(heads * accounting.score_bytes(length, 2, with_softmax=True)))

  rows = [row(f'this config, T={length}: one head', length),
          row(f'this config: one layer ({m.num_heads} heads)', length, m.num_heads),
          row('example: one head, T=8192', 8192)]
  return (['', '## Attention scores (T x S per head; the softmax output doubles it)', '']
          + _table(('', 'fp32', 'fp16', 'fp16 + softmax output'), rows))


def _per_device(config, model, vocab_size, total):
  """The training state and activations per device under config.mesh, and how the sharding
  rules cut the parameters."""
  m, length, batch_size = config.model, config.data.max_length, config.train.batch_size
  mesh_config = config.get('mesh', {})
  mesh = accounting.abstract_mesh(mesh_config)
  p_dev = accounting.per_device_param_bytes(model, mesh_config)
  act = accounting.activation_bytes(m, vocab_size, batch_size, length, mesh_config)
  sizes = ' x '.join(f'{a}={mesh.shape[a]}' for a in sharding.MESH_AXES)
  plural = 's' if mesh.size > 1 else ''
  rows = [('parameters', human_bytes(p_dev))]
  if moe.num_moe_layers(m):
    experts = sum(b / f for path, _, b, f in accounting.param_shards(model, mesh_config)
                  if _routed_expert(m, path))
    rows.append((f'of which the routed experts (E = {m.moe_experts}, cut in '
                 f'expert={mesh.shape["expert"]} by the expert axis)', human_bytes(experts)))
  rows += [('gradients (sharded like the parameters)', human_bytes(p_dev)),
          ('AdamW moments mu, nu (2 x parameters)', human_bytes(2 * p_dev)),
          ('**state total**', f'**{human_bytes(4 * p_dev)}**'),
          (f'activations, batch {batch_size} (estimate, see '
           'models.accounting.activation_bytes)', human_bytes(act)),
          ('**total**', f'**{human_bytes(4 * p_dev + act)}**')]
  out = ['', f'## Per device under the mesh {sizes} ({mesh.size} device{plural}; float32)', '']
  out += _table(('', 'bytes per device'), rows)
  out += ['', 'Parameters by the number of pieces the rules cut them into (the rest of the '
          'mesh holds copies; the data axis always does):']
  by_factor = {}  # pieces -> [parameter count, components]
  for path, count, _, factor in accounting.param_shards(model, mesh_config):
    entry = by_factor.setdefault(factor, [0, set()])
    entry[0] += count
    entry[1].add(accounting.component_of(path))
  for factor in sorted(by_factor, reverse=True):
    count, components = by_factor[factor]
    out.append(f'- /{factor}: {_n(count)} ({100 * count / total:.1f}%): '
               f'{", ".join(sorted(components))}')
  return out


def _routed_expert(m, path):
  """Whether a parameter path is a routed expert's weight: the FFN of an MoE block, not its
  router or shared experts."""
  names = [str(p) for p in path]
  if 'ffn' not in names or 'router' in names or 'shared' in names:
    return False
  layer = next((p for p in path if isinstance(p, int)), None)
  return moe.is_moe_layer(m, layer)


FLAGS = flags.FLAGS


def define_flags():
  """The CLI flags, defined only when run as a program (tests import this module)."""
  config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py).', lock_config=True)
  flags.DEFINE_integer('vocab_size', 0, 'V; 0 = the configured task\'s tokenizer vocabulary '
                       '(data.vocab_size, doubled less 6 specials for text_pairs with two models).')
  flags.mark_flag_as_required('config')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if FLAGS.vocab_size < 0:
    print(f'config error: --vocab_size={FLAGS.vocab_size} must be positive (0 = the configured '
          "task's tokenizer)", file=sys.stderr)
    sys.exit(2)
  config = validation.resolve(FLAGS.config.unlock())
  try:
    validation.validate(config)
    text = report(config, state_lib.model_vocab_size(
        config, FLAGS.vocab_size or task_vocab_size(config.data)))
  except ValueError as e:  # options.ConfigError, or an arch the closed forms do not cover
    print(f'config error: {e}', file=sys.stderr)
    sys.exit(2)
  print(text)


if __name__ == '__main__':
  define_flags()
  app.run(main)
