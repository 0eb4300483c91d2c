"""Evaluates the newest checkpoint of a run: `python eval.py --workdir=DIR`.

Writes DIR/eval.json (loss and perplexity per split, greedy translation exact match and token
accuracy) and DIR/loss_curve.png (train and validation loss from metrics.jsonl).
"""

import functools
import json
import math
import os
import sys

from absl import app
from absl import flags
from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from data import pipeline
from layers import positions as positions_lib
from models import decoding
import train

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir.')
_SPLIT = flags.DEFINE_list('split', ['validation', 'test'], 'Splits to evaluate.')
_MAX_EXAMPLES = flags.DEFINE_integer('max_examples', 0,
                                     'Translate at most this many examples per split (0 = all).')
_TRANSLATE = flags.DEFINE_list('translate', [], 'Extra splits to translate only (e.g. test_long); '
                               'exact match is reported per source-length bucket.')
_LENGTHS = flags.DEFINE_list('lengths', [], 'Length extrapolation: evaluation lengths as multiples '
                             'of the training length, e.g. 1,2,4,8 (empty = skip).')
_MODES = flags.DEFINE_list('modes', ['non_overlapping', 'sliding'],
                           'Extrapolation windows: non_overlapping and/or sliding.')
_STRIDE = flags.DEFINE_float('stride', 0.5, 'Sliding-window stride as a fraction of the window.')
_STREAM_SPLIT = flags.DEFINE_string('stream_split', 'test', 'Split streamed for extrapolation.')
_DECODE = flags.DEFINE_enum('decode', 'greedy', ['greedy', 'beam', 'sample'],
                            'Translation decoding (KV cache): greedy, beam or sample.')
_NUM_BEAMS = flags.DEFINE_integer('num_beams', 4, 'Beam width (--decode=beam).')
_LENGTH_PENALTY = flags.DEFINE_float('length_penalty', 0.6, 'GNMT length penalty alpha (beam).')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'Sampling temperature (--decode=sample).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'Sample from the k most likely tokens (0 = all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Nucleus sampling mass (1.0 = off).')
_PLOT_ATTENTION = flags.DEFINE_integer('plot_attention', 0, 'Draw attention heat maps (one panel '
                                       'per head) of this many test sentences (0 = none).')
_ROPE_SCALING = flags.DEFINE_string('rope_scaling', None, 'Override RoPE scaling at evaluation '
                                    'only: none, pi:F, ntk:F or yarn:F (F the factor).')
# Comparing runs (tools/compare.py): overlaid loss curves of workdirs or sweep directories.
_COMPARE = flags.DEFINE_list('compare', [], 'Workdirs and/or sweep directories to compare '
                             '(instead of evaluating --workdir); writes --out and prints a table.')
_SMOOTH = flags.DEFINE_string('smooth', None, 'With --compare: train-curve smoothing, ema:BETA '
                              '(or BETA), ma:K, or none.')
_LOGY = flags.DEFINE_bool('logy', False, 'With --compare: log-scale loss axis.')
_LOGX = flags.DEFINE_bool('logx', False, 'With --compare: log-scale step axis.')
_TARGET_LOSS = flags.DEFINE_float('target_loss', None, 'With --compare: report the first step '
                                  'whose validation loss is at most this.')
_OUT = flags.DEFINE_string('out', None, 'With --compare: the PNG to write (default '
                           'DIR/compare.png for the first DIR).')


# --- Several processes (train.py's --coordinator_address, --num_processes, --process_id) ---------
# Every process restores the checkpoint, evaluates its share of the batches, sentences and windows
# on its own devices, and the shares are gathered in process order, so every process holds the
# whole result; only process 0 writes eval.json and the plots.

def process_share(n, align=1):
  """(start, stop): this process's contiguous share of `n` items (all of them in one process),
  cut at multiples of `align`."""
  per = -(-n // (align * jax.process_count())) * align
  return min(n, jax.process_index() * per), min(n, (jax.process_index() + 1) * per)


def gather_rows(rows):
  """Every process's `rows` (an array whose leading axis is its share), concatenated in process
  order; `rows` itself in a single-process run."""
  return np.concatenate(train.allgather_ragged(rows))


def gather_token_lists(lists):
  """`gather_rows` for lists of token ids of any lengths."""
  if jax.process_count() == 1:
    return lists
  lengths = gather_rows(np.int32([len(x) for x in lists]))
  tokens = gather_rows(np.int32([t for x in lists for t in x]))
  if not len(lengths):
    return []
  return [x.tolist() for x in np.split(tokens, np.cumsum(lengths)[:-1])]


def gather_sums(sums):
  """Summed metrics added over the processes."""
  if jax.process_count() == 1:
    return sums
  return {k: np.sum(multihost_utils.process_allgather(np.float64(v))) for k, v in sums.items()}


def load_run(workdir):
  """Returns (config, graphdef, variables, step) of the newest checkpoint in `workdir`, where
  `nnx.merge(graphdef, variables)` is the model (parameters and buffers in one `nnx.State`)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'eval: {workdir} has no config.json; is it a train.py workdir?')
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  if config.model.get('attention_impl') == 'ring':
    # Ring attention needs the training mesh; eval runs on one device, and `xla` is the same
    # exact attention.
    config.model.attention_impl = 'xla'
  mngr = train.checkpoint_manager(workdir, config)
  if mngr.latest_step() is None:
    raise FileNotFoundError(f'eval: no checkpoint in {os.path.join(workdir, "checkpoints")}')
  tokenizer = pipeline.get_tokenizer(config.data)
  graphdef, _, state = train.create_state(config, tokenizer.vocab_size)
  state, _ = train.restore_state(mngr, state)
  mngr.close()
  graphdef, variables = nnx.split(nnx.merge(graphdef, *train.model_variables(state)))
  return config, graphdef, variables, int(state['step'])


LENGTH_BUCKETS = (0, 7, 13, 19, 26, 33)  # source-length bucket starts (words)


def _fill_masks(model, examples, tokenizer, batch_size=64):
  """Encoder-only, non-autoregressive: every target token (the reference's length, an oracle) is
  `<mask>`; all are predicted in one pass. Returns the predicted target token lists."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def predict(params, inputs, segment_ids):
    logits = nnx.merge(graphdef, params)({'inputs': inputs, 'segment_ids': segment_ids})
    return jnp.argmax(logits, axis=-1)  # [B, L]

  rows = [[tokenizer.bos_id] + e['source_ids'] + [tokenizer.sep_id]
          + [tokenizer.mask_id] * len(e['target_ids']) + [tokenizer.eos_id] for e in examples]
  length = max(len(r) for r in rows)
  model.encoder.position.check_length(length)
  hyps = []
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))
    inputs = np.zeros((batch_size, length), np.int32)
    for i, r in enumerate(chunk):
      inputs[i, :len(r)] = r
    pred = np.asarray(predict(params, inputs, (inputs > 0).astype(np.int32)))
    for i, e in enumerate(examples[start:start + batch_size]):
      first = len(e['source_ids']) + 2
      hyps.append(pred[i, first:first + len(e['target_ids'])].tolist())
  return hyps


def generate_translations(config, model, examples, tokenizer, *, method='greedy', max_new=None,
                          **decode_kwargs):
  """Translations of `examples` by the run's architecture.

  decoder_only continues `<bos> source <sep>`; encoder_decoder and rnn_seq2seq decode from `<bos>`
  over the encoded `source <eos>` (all with the KV cache / recurrent state, `models.decoding`);
  encoder_only fills a fully masked target of the reference length in one pass (an oracle length:
  a non-autoregressive score, not comparable one to one with the others). `max_new`: the decoding
  budget, by default one more token than the longest reference.
  """
  arch = config.model.arch
  if arch == 'encoder_only':
    return _fill_masks(model, examples, tokenizer)
  max_new = max_new or max(len(e['target_ids']) for e in examples) + 1
  kwargs = dict(max_new=max_new, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, method=method,
                **decode_kwargs)
  if arch == 'decoder_only':
    prompts = [[tokenizer.bos_id] + e['source_ids'] + [tokenizer.sep_id] for e in examples]
    # Longer test splits need a longer buffer than training (that is the extrapolation).
    length = max(config.data.max_length, max(len(p) for p in prompts) + max_new)
    model.decoder.position.check_length(length)
    if method == 'greedy' and not decode_kwargs:
      return decoding.greedy_translate(model, prompts, length=length, max_new=max_new,
                                       eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    return decoding.generate(model, prompts, length=length, **kwargs)
  sources = [e['source_ids'] + [tokenizer.eos_id] for e in examples]
  if hasattr(model, 'encoder') and hasattr(model.encoder, 'position'):
    model.encoder.position.check_length(max(len(x) for x in sources))
    model.decoder.position.check_length(max_new + 1)
  return decoding.generate(model, [[tokenizer.bos_id]] * len(examples), sources=sources, **kwargs)


def bleu(hyps, refs, tokenizer):
  """Corpus BLEU (sacrebleu, 0-100) of token lists against one reference each."""
  import sacrebleu  # pylint: disable=g-import-not-at-top
  return float(sacrebleu.corpus_bleu([tokenizer.decode(h) for h in hyps],
                                     [[tokenizer.decode(r) for r in refs]]).score)


SAMPLE_BATCH = 64  # rows per sampling batch (models.decoding.generate's default)


def translate(config, model, examples, tokenizer, *, method='greedy', **decode_kwargs):
  """Translates `examples`; returns exact match, token accuracy, BLEU and a few samples."""
  refs = [e['target_ids'] for e in examples]
  # Every process decodes its share with the budget of the whole split. Sampling cuts the shares
  # at whole decoding batches, each keyed by its place in the split: the samples of one process.
  if method == 'sample':
    rows = min(SAMPLE_BATCH, len(examples))
    start, stop = process_share(len(examples), align=rows)
    decode_kwargs = dict(decode_kwargs, batch_size=rows, row_offset=start)
  else:
    start, stop = process_share(len(examples))
  hyps = (generate_translations(config, model, examples[start:stop], tokenizer, method=method,
                                max_new=max(len(r) for r in refs) + 1, **decode_kwargs)
          if stop > start else [])
  if jax.process_count() > 1:
    print(f'eval: process {jax.process_index()} of {jax.process_count()} decodes sentences '
          f'{start}-{stop} of {len(examples)}', file=sys.stderr)
  hyps = gather_token_lists(hyps)
  exact = sum(h == r for h, r in zip(hyps, refs))
  # Token accuracy: reference positions (and the final eos) predicted correctly at the same index.
  correct = total = 0
  for h, r in zip(hyps, refs):
    r_eos, h_eos = r + [tokenizer.eos_id], h + [tokenizer.eos_id]
    correct += sum(a == b for a, b in zip(h_eos, r_eos))
    total += len(r_eos)
  samples = [{'source': e['source'], 'reference': e['target'], 'output': tokenizer.decode(h)}
             for e, h in zip(examples[:5], hyps[:5])]
  buckets = {}
  for e, h, r in zip(examples, hyps, refs):
    n = len(e['source_ids'])
    lo = next(b for b in reversed(LENGTH_BUCKETS) if n >= b)
    hit, cnt = buckets.get(lo, (0, 0))
    buckets[lo] = (hit + (h == r), cnt + 1)
  by_length = [{'source_words': f'{lo}-{hi - 1}', 'exact_match': hit / cnt, 'n': cnt}
               for lo, hi in zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:] + (10 ** 6,))
               if lo in buckets for hit, cnt in [buckets[lo]]]
  return {'exact_match': exact / len(refs), 'token_accuracy': correct / total,
          'bleu': bleu(hyps, refs, tokenizer), 'n': len(refs), 'by_length': by_length,
          'samples': samples, 'decoding': method}


def _window_losses(model, tokens, in_target, starts, length, batch_size):
  """Per-position losses of windows `tokens[start:start + length + 1]`.

  Returns:
    (ce, target) `[num_windows, length]`: next-token cross-entropy, and 1 where the predicted token
    is on the target side.
  """
  @jax.jit
  def forward(inputs, targets):
    logits = model({'inputs': inputs})  # [B, L, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, L]

  idx = np.asarray(starts)[:, None] + np.arange(length + 1)[None]  # [W, L + 1]
  windows, masks = tokens[idx], in_target[idx]
  ce = []
  for i in range(0, len(windows), batch_size):
    chunk = windows[i:i + batch_size]
    pad = batch_size - len(chunk)  # fixed shapes: one compilation per length
    chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)]) if pad else chunk
    ce.append(np.asarray(forward(chunk[:, :-1], chunk[:, 1:]))[:batch_size - pad])
  return np.concatenate(ce), masks[:, 1:]


def _shared_window_losses(model, tokens, in_target, starts, length, batch_size):
  """`_window_losses` of this process's share of the windows, gathered from every process."""
  start, stop = process_share(len(starts))
  if stop > start:
    ce, tgt = _window_losses(model, tokens, in_target, starts[start:stop], length, batch_size)
  else:
    ce, tgt = np.zeros((0, length), np.float32), np.zeros((0, length), in_target.dtype)
  return gather_rows(ce), gather_rows(tgt)


def extrapolate(config, model, multiples, modes, stride, split):
  """Loss of a stream at `multiple x max_length` tokens per window (attention across pairs).

  non_overlapping scores every position of disjoint windows; sliding moves the window by
  `stride x length` and scores only the positions it has not scored before, so each has at least
  `(1 - stride) x length` tokens of context (except in the first window).

  Returns:
    (rows for eval.json, {length: mean loss per window position} of the non-overlapping windows).
  """
  tokens, in_target = pipeline.stream_tokens(config.data, split)
  rows, per_position = [], {}
  for multiple in multiples:
    length = int(multiple * config.data.max_length)
    batch_size = max(1, 8192 // length)
    for mode in modes:
      if mode == 'non_overlapping':
        starts = np.arange(0, len(tokens) - length, length)
        ce, tgt = _shared_window_losses(model, tokens, in_target, starts, length, batch_size)
        scored = np.ones_like(ce, bool)
        per_position[length] = ce.mean(0)
      elif mode == 'sliding':
        step = max(1, int(stride * length))
        starts = np.arange(0, len(tokens) - length, step)
        ce, tgt = _shared_window_losses(model, tokens, in_target, starts, length, batch_size)
        scored = np.zeros_like(ce, bool)
        scored[0] = True
        scored[1:, length - step:] = True
      else:
        raise ValueError(f'--modes: {mode!r} unknown; valid: non_overlapping, sliding')
      loss = float(ce[scored].mean())
      target_loss = float((ce * tgt)[scored].sum() / max(tgt[scored].sum(), 1.0))
      rows.append({'multiple': multiple, 'length': length, 'mode': mode, 'loss': loss,
                   'target_loss': target_loss, 'ppl': math.exp(min(loss, 50.0)),
                   'windows': int(len(starts))})
  return rows, per_position


def _save(fig, ax, path):
  """Legend, grid, tight layout; writes the PNG and frees the figure."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def plot_per_position(workdir, per_position, title):
  """Loss against position in the window, one line per evaluation length (extrapolation.png)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4))
  for length, curve in sorted(per_position.items()):
    k = max(1, length // 64)  # smooth long curves over k positions
    smooth = np.convolve(curve, np.ones(k) / k, mode='valid')
    ax.plot(np.arange(len(smooth)) + k // 2, smooth, label=f'L={length}')
  ax.set_xlabel('position in window')
  ax.set_ylabel('loss (nats/token)')
  ax.set_title(title)
  return _save(fig, ax, os.path.join(workdir, 'extrapolation.png'))


def attention_batch(config, example, tokenizer):
  """The teacher-forced one-row batch of `example` for the run's arch, and the axis labels.

  Returns:
    (batch, query words, key words for 'self', key words for 'cross').
  """
  words = lambda ids: [tokenizer.tokens[i] for i in ids]  # noqa: E731
  src, tgt = example['source_ids'], example['target_ids']
  arr = lambda ids: np.asarray([ids], np.int32)  # noqa: E731
  if config.model.arch in ('encoder_decoder', 'rnn_seq2seq'):
    src_in, tgt_in = src + [tokenizer.eos_id], [tokenizer.bos_id] + tgt
    batch = {'src_inputs': arr(src_in), 'tgt_inputs': arr(tgt_in)}
    return batch, words(tgt_in), words(tgt_in), words(src_in)
  seq = [tokenizer.bos_id] + src + [tokenizer.sep_id] + tgt + [tokenizer.eos_id]
  if config.model.arch == 'decoder_only':
    seq = seq[:-1]
  return {'inputs': arr(seq)}, words(seq), words(seq), None


def plot_attention_maps(workdir, config, model, examples, tokenizer, layer=-1):
  """Heat maps of the last layer's attention for a few sentences, one panel per head.

  Self-attention (queries down, keys across) and, for encoder-decoder and RNN, cross-attention
  (target words down, source words across); for decoder-only also the target-rows x source-columns
  block of its self-attention, its alignment. Probabilities come from
  `layers.attention_xla.attention_weights` on the layer's own q/k. Writes attention_<i>_<kind>.png.

  Returns:
    The written paths.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  paths = []
  for i, example in enumerate(examples):
    batch, q_words, self_words, cross_words = attention_batch(config, example, tokenizer)
    maps = dict(model.attention_weights(batch)[layer])
    panels = {kind: (np.asarray(w[0]), q_words, self_words if kind == 'self' else cross_words)
              for kind, w in maps.items()}
    if config.model.arch == 'decoder_only':
      sep = q_words.index(tokenizer.tokens[tokenizer.sep_id])
      panels['target_to_source'] = (np.asarray(maps['self'][0])[:, sep:, 1:sep],
                                    q_words[sep:], q_words[1:sep])
    for kind, (w, rows, cols) in panels.items():
      heads = w.shape[0]
      fig, axes = plt.subplots(1, heads, figsize=(0.35 * len(cols) * heads + 2,
                                                  0.35 * len(rows) + 1.5), squeeze=False)
      for h, ax in enumerate(axes[0]):
        ax.imshow(w[h], cmap='viridis', vmin=0.0, vmax=1.0, aspect='auto')
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=7)
        ax.set_yticks(range(len(rows)), rows if h == 0 else [''] * len(rows), fontsize=7)
        ax.set_title(f'head {h}', fontsize=8)
      fig.suptitle(f'{config.model.arch} layer {layer} {kind}: {example["source"]}', fontsize=8)
      fig.tight_layout()
      path = os.path.join(workdir, f'attention_{i}_{kind}.png')
      fig.savefig(path, dpi=100)
      plt.close(fig)
      paths.append(path)
  return paths


def plot_loss_curve(workdir):
  """Draws train and validation loss against step from metrics.jsonl into loss_curve.png."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  series = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      row = json.loads(line)
      series.setdefault(row['split'], []).append((row['step'], row['loss']))
  fig, ax = plt.subplots(figsize=(6, 4))
  for split, points in sorted(series.items()):
    steps, losses = zip(*points)
    ax.plot(steps, losses, label=split, marker='o' if split != 'train' else None)
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats/token)')
  ax.set_yscale('log')
  ax.set_title(os.path.basename(os.path.normpath(workdir)))
  return _save(fig, ax, os.path.join(workdir, 'loss_curve.png'))


def parse_rope_scaling(text):
  """'ntk:4' -> ('ntk', 4.0); 'none' -> ('none', 1.0)."""
  name, _, factor = text.partition(':')
  return name, float(factor) if factor else 1.0


def evaluate_run(workdir, splits, max_examples=0, *, translate_splits=(), lengths=(),
                 modes=('non_overlapping', 'sliding'), stride=0.5, stream_split='test',
                 rope_scaling=None, decode=None, plot_attention=0):
  """Evaluates the newest checkpoint in `workdir`; returns (and writes) the eval.json dict.

  Args:
    workdir: a train.py workdir.
    splits: splits for loss/perplexity and translation.
    max_examples: translate at most this many examples per split (0 = all).
    translate_splits: further splits for translation only (longer sentences).
    lengths: extrapolation multiples of the training length (empty = none).
    modes, stride, stream_split: see `extrapolate`.
    rope_scaling: None or e.g. 'ntk:4', applied at evaluation only.
    decode: None (greedy) or a dict of `models.decoding.generate` options, e.g.
      {'method': 'beam', 'num_beams': 4, 'length_penalty': 0.6}.
    plot_attention: draw the attention maps of this many test sentences (0 = none).
  """
  config, graphdef, params, step = load_run(workdir)
  tokenizer = pipeline.get_tokenizer(config.data)
  model = nnx.merge(graphdef, params)
  if rope_scaling is not None:
    name, factor = parse_rope_scaling(rope_scaling)
    positions_lib.with_rope_scaling(model, name, factor)
    graphdef, params = nnx.split(model)
  if lengths and config.model.arch != 'decoder_only':
    raise ValueError(f'--lengths (stream extrapolation) needs a decoder_only run, not '
                     f'{config.model.arch!r}')
  for multiple in lengths:  # before any compilation: a learned table cannot embed longer inputs
    model.decoder.position.check_length(int(multiple * config.data.max_length))
  decode = dict(decode or {})
  eval_fn = jax.jit(functools.partial(train.eval_step, graphdef))
  result = {'step': step, 'loss': {}, 'perplexity': {}, 'accuracy': {}, 'translation': {}}
  for split in splits:
    m = train.finalize(gather_sums(train.evaluate_sums(
        eval_fn, params, config, split, 0, share=(jax.process_index(), jax.process_count()))))
    result['loss'][split] = m['loss']
    result['perplexity'][split] = math.exp(min(m['loss'], 50.0))
    result['accuracy'][split] = m['accuracy']
    examples = pipeline.load_examples(config.data, split)
    if max_examples:
      examples = examples[:max_examples]
    result['translation'][split] = translate(config, model, examples, tokenizer, **decode)
  for split in translate_splits:
    examples = pipeline.load_examples(config.data, split)
    if max_examples:
      examples = examples[:max_examples]
    result['translation'][split] = translate(config, model, examples, tokenizer, **decode)
  if lengths:
    result['rope_scaling'] = rope_scaling or 'as trained'
    result['extrapolation'], per_position = extrapolate(config, model, lengths, modes, stride,
                                                        stream_split)
    if per_position and jax.process_index() == 0:
      result['extrapolation_plot'] = plot_per_position(
          workdir, per_position, f'{config.model.position}, rope_scaling={rope_scaling}')
  main_split = 'test' if 'test' in splits else splits[-1]
  result['exact_match'] = result['translation'][main_split]['exact_match']
  result['token_accuracy'] = result['translation'][main_split]['token_accuracy']
  if jax.process_index() > 0:  # process 0 writes the results and draws the plots
    return result
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    json.dump(result, f, indent=2)
  if plot_attention:
    examples = pipeline.load_examples(config.data, 'test' if 'test' in splits else splits[-1])
    result['attention_plots'] = plot_attention_maps(workdir, config, model,
                                                    examples[:plot_attention], tokenizer)
  result['loss_curve'] = plot_loss_curve(workdir)
  return result


def _decode_options():
  """The --decode flags as `models.decoding.generate` options (None = plain greedy)."""
  if _DECODE.value == 'greedy':
    return None
  if _DECODE.value == 'beam':
    return {'method': 'beam', 'num_beams': _NUM_BEAMS.value,
            'length_penalty': _LENGTH_PENALTY.value}
  return {'method': 'sample', 'temperature': _TEMPERATURE.value, 'top_k': _TOP_K.value,
          'top_p': _TOP_P.value}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
  if train.host_malloc_wanted(flags.FLAGS.host_malloc):
    train.tune_host_malloc()
  if _COMPARE.value:
    from tools import compare  # pylint: disable=g-import-not-at-top
    out = _OUT.value or os.path.join(_COMPARE.value[0], 'compare.png')
    try:
      table = compare.compare(_COMPARE.value, out, smoothing=_SMOOTH.value, logy=_LOGY.value,
                              logx=_LOGX.value, target_loss=_TARGET_LOSS.value)
    except (FileNotFoundError, ValueError) as e:
      print(str(e), file=sys.stderr)
      sys.exit(2)
    print(table)
    print(f'\nwrote {out}')
    return
  if not _WORKDIR.value:
    print('eval: --workdir is required', file=sys.stderr)
    sys.exit(2)
  train.init_distributed(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                         flags.FLAGS.process_id, flags.FLAGS.multihost)
  try:
    result = evaluate_run(
        _WORKDIR.value, _SPLIT.value, _MAX_EXAMPLES.value, translate_splits=_TRANSLATE.value,
        lengths=[float(x) for x in _LENGTHS.value], modes=_MODES.value, stride=_STRIDE.value,
        stream_split=_STREAM_SPLIT.value, rope_scaling=_ROPE_SCALING.value,
        decode=_decode_options(), plot_attention=_PLOT_ATTENTION.value)
  except ValueError as e:
    print(f'eval: {e}', file=sys.stderr)
    sys.exit(2)
  except FileNotFoundError as e:
    print(str(e), file=sys.stderr)
    sys.exit(1)
  if jax.process_index() > 0:
    return
  for split in _SPLIT.value + _TRANSLATE.value:
    t = result['translation'][split]
    # --translate splits are decoded only (no loss pass over them).
    loss = (f'loss {result["loss"][split]:.4f}  ppl {result["perplexity"][split]:.3f}  '
            if split in result['loss'] else '')
    print(f'{split}: {loss}exact_match {t["exact_match"]:.4f}  token_accuracy '
          f'{t["token_accuracy"]:.4f}  bleu {t["bleu"]:.2f}  (n={t["n"]})')
  for row in result.get('extrapolation', []):
    print(f'extrapolation x{row["multiple"]:g} L={row["length"]} {row["mode"]}: loss '
          f'{row["loss"]:.4f} target_loss {row["target_loss"]:.4f} ppl {row["ppl"]:.3f}')
  print(f'wrote {os.path.join(_WORKDIR.value, "eval.json")} and {result["loss_curve"]}')


if __name__ == '__main__':
  train.define_distributed_flags()
  train.define_host_malloc_flag()
  app.run(main)
