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

from data import text_corpus
from data import tokenizer as tokenizer_lib
from data import toy_translation
from layers import sharding
from models import accounting
from training import validation


def toy_tokenizer():
  """The toy translation task's tokenizer, without generating the data."""
  return tokenizer_lib.Tokenizer.from_words(toy_translation.vocabulary())


def toy_vocab_size():
  """V of the toy translation task (its tokenizer's vocabulary), without generating the data."""
  return toy_tokenizer().vocab_size


def task_vocab_size(data_config):
  """V of the configured task's tokenizer, without preparing data: the toy vocabulary, or for
  text_pairs / text_lm the SentencePiece vocabulary data.vocab_size and data.shared_vocab give."""
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
  stacks, cross = accounting.stack_layout(m.arch)
  layers, d, h = m.num_layers * stacks, m.d_model, m.d_model // m.num_heads
  total = sum(counted.values())
  out = [f'# Accounting: arch={m.arch}, L={m.num_layers} per stack, D={d}, N={m.num_heads}, '
         f'K={m.num_kv_heads}, H={h}, F={m.d_ff}, V={vocab_size}, T={length}, ffn={m.ffn}, '
         f'norm={m.norm}, position={m.position}, attention={m.attention}, use_bias={m.use_bias}',
         '', '## Parameters (counted on jax.eval_shape of models.build = closed form)', '']
  gated = m.ffn in accounting.GATED_FFNS
  layer = (counted['attention'] + counted['ffn']) / layers  # self-attention + FFN
  attn_form = ('4·D²' if m.num_kv_heads == m.num_heads else '2·D² + 2·D·K·H')
  rows = [
      ('embedding', '', '', _n(counted['embedding']), 'V·D' + ('' if stacks == 1 or m.get(
          'share_embeddings', True) else ' x2 (not shared)')),
      ('positions', '', '', _n(counted['positions']),
       {'learned': 'T_max·D per stack', 't5_bias': 'buckets·N per stack'}.get(m.position, '0')),
      ('attention', _n(counted['attention'] / layers), layers, _n(counted['attention']),
       attn_form + (' + biases' if m.use_bias else '') + (
           ' + 2·k·T (E, F)' if m.attention == 'linformer' else '')),
  ]
  if cross:
    rows.append(('cross-attention', _n(counted['cross_attention'] / m.num_layers), m.num_layers,
                 _n(counted['cross_attention']), attn_form + (' + biases' if m.use_bias else '')))
  rows += [
      ('FFN', _n(counted['ffn'] / layers), layers, _n(counted['ffn']),
       ('3·D·F' if gated else '2·D·F') + (' + biases' if m.use_bias else '')),
      ('norms', '', '', _n(counted['norms']),
       ('2·D' if m.norm == 'layernorm' else 'D') + ' per norm'),
      ('output', '', '', '0', 'tied to the embedding'),
      ('**total**', _n(layer) if not cross else
       f'enc {_n(layer)}, dec {_n(layer + counted["cross_attention"] / m.num_layers)}', layers,
       f'**{_n(total)}**', ''),
  ]
  out += _table(('component', 'per layer', 'layers', 'total', 'closed form'), rows)
  out += ['', f'A layer (self-attention + FFN) holds {_n(layer)} = {layer / d ** 2:.2f}·D² '
          f'parameters, {100 * counted["ffn"] / layers / layer:.1f}% of them in the FFN.']

  fl = accounting.forward_flops(m, vocab_size, length)
  fwd_full = fl['matmul'] + fl['scores']
  fwd_causal = fl['matmul'] + fl['scores_causal']
  out += ['', f'## FLOPs per token (T={length}; per row / T; training = 3 x forward: the backward '
          'pass costs two matmuls per forward matmul)', '']
  rows = [('matmuls (2 x weights touched, incl. D x V output)', _n(fl['matmul'] / length),
           _n(3 * fl['matmul'] / length)),
          ('attention scores, full T x S (as the xla kernel computes them)',
           _n(fl['scores'] / length), _n(3 * fl['scores'] / length)),
          ('attention scores, only the pairs the mask keeps (causal: about half)',
           _n(fl['scores_causal'] / length),
           _n(3 * fl['scores_causal'] / length)),
          ('**total** (full scores)', _n(fwd_full / length), _n(3 * fwd_full / length)),
          ('total (kept pairs only)', _n(fwd_causal / length), _n(3 * fwd_causal / length))]
  out += _table(('', 'inference (forward)', 'training'), rows)
  out += ['', f'Per step (batch {config.train.batch_size} x {length} tokens): '
          f'{3 * fwd_full * config.train.batch_size:,.3g} training FLOPs.']
  if m.attention != 'dense':
    out.append(f'Scores are counted as exact dense attention; model.attention={m.attention!r} '
               'computes its own pattern, so its score FLOPs differ.')

  out += ['', '## KV cache (2 x layers x K x H x length x bytes)', '']
  rows = []
  if m.arch == 'encoder_only':
    out += ['Encoder-only: no autoregressive decoding, no KV cache.']
  else:
    elems = accounting.kv_cache_elements(m.num_layers, m.num_kv_heads, h, length)
    if cross:
      elems *= 2  # the cross-attention keys/values of the source (length T), cached once
    rows.append((f'this config, one sequence of {length}' + (' (self + cross)' if cross else ''),
                 _n(elems), human_bytes(4 * elems), human_bytes(2 * elems)))
  for name, kv in (('MHA', 32), ('GQA, 8 KV heads', 8), ('MQA', 1)):
    elems = accounting.kv_cache_elements(32, kv, 64, 2048)
    rows.append((f'example: 32 layers, 32 heads, H 64, length 2048, {name}', _n(elems),
                 human_bytes(4 * elems), human_bytes(2 * elems)))
  out += _table(('', 'elements', 'fp32', 'fp16/bf16'), rows)
  out += ['', 'The example is 2 x 32 layers x 32 heads x 64 x 2048 = 268,435,456 elements (the '
          '"268 MB" some texts print is that element count, not bytes); 8 KV heads keep a quarter '
          'of it, one KV head a 32nd.']

  out += ['', '## Attention scores (T x S per head; the softmax output doubles it)', '']

  def score_row(label, length, heads=1):  # fp32, fp16, fp16 with the softmax output kept
    return (label, human_bytes(heads * accounting.score_bytes(length, 4)),
            human_bytes(heads * accounting.score_bytes(length, 2)),
            human_bytes(heads * accounting.score_bytes(length, 2, with_softmax=True)))

  rows = [score_row(f'this config, T={length}: one head', length),
          score_row(f'this config: one layer ({m.num_heads} heads)', length, m.num_heads),
          score_row('example: one head, T=8192', 8192)]
  out += _table(('', 'fp32', 'fp16', 'fp16 + softmax output'), rows)

  mesh_config = config.get('mesh', {})
  mesh = accounting.abstract_mesh(mesh_config)
  shards = accounting.param_shards(model, mesh_config)
  p_dev = accounting.per_device_param_bytes(model, mesh_config)
  act = accounting.activation_bytes(m, vocab_size, config.train.batch_size, length, mesh_config)
  sizes = ' x '.join(f'{a}={mesh.shape[a]}' for a in sharding.MESH_AXES)
  plural = 's' if mesh.size > 1 else ''
  out += ['', f'## Per device under the mesh {sizes} ({mesh.size} device{plural}; float32)', '']
  rows = [('parameters', human_bytes(p_dev)), ('gradients (sharded like the parameters)', human_bytes(p_dev)),
          ('AdamW moments mu, nu (2 x parameters)', human_bytes(2 * p_dev)),
          ('**state total**', f'**{human_bytes(4 * p_dev)}**'),
          (f'activations, batch {config.train.batch_size} (estimate, see '
           'models.accounting.activation_bytes)', human_bytes(act)),
          ('**total**', f'**{human_bytes(4 * p_dev + act)}**')]
  out += _table(('', 'bytes per device'), rows)
  by_factor = {}
  for path, count, _, factor in shards:
    entry = by_factor.setdefault(factor, [0, set()])
    entry[0] += count
    entry[1].add(accounting.component_of(path))
  out += ['', 'Parameters by the number of pieces the rules cut them into (the rest of the '
          'mesh holds copies; the data axis always does):']
  for factor in sorted(by_factor, reverse=True):
    count, comps = by_factor[factor]
    out.append(f'- /{factor}: {_n(count)} ({100 * count / total:.1f}%): {", ".join(sorted(comps))}')
  return '\n'.join(out)


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
    text = report(config, FLAGS.vocab_size or task_vocab_size(config.data))
  except ValueError as e:  # validation.ConfigError, or an arch the closed forms do not cover
    print(f'config error: {e}', file=sys.stderr)
    sys.exit(2)
  print(text)


if __name__ == '__main__':
  define_flags()
  app.run(main)
