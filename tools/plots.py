"""The pictures of a run: loss curve, loss per position of the extrapolation windows, attention maps."""

import json
import os

import numpy as np

from data import pipeline


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




def write_eval_outputs(workdir, result, run, splits, plot_attention=0):
  """Writes eval.json and the pictures of `training.evaluation.evaluate_run`'s (result, run).

  The extrapolation plot (with lengths), `plot_attention` attention maps of test sentences, and
  the loss curve; their paths are added to `result` (the plot paths drawn after eval.json is
  written stay out of the file).
  """
  if run.per_position:
    result['extrapolation_plot'] = plot_per_position(
        workdir, run.per_position,
        f'{run.config.model.position}, rope_scaling={result["rope_scaling"]}')
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    json.dump(result, f, indent=2)
  if plot_attention:
    examples = pipeline.load_examples(run.config.data, 'test' if 'test' in splits else splits[-1])
    result['attention_plots'] = plot_attention_maps(
        workdir, run.config, run.model, examples[:plot_attention], run.tokenizer)
  result['loss_curve'] = plot_loss_curve(workdir)
  return result
