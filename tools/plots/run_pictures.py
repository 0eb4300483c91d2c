"""The pictures of a run: loss curve, loss per position of extrapolation windows, passkey retrieval
per length and depth, attention maps."""

import json

import numpy as np

import models
from data import pipeline
from training import paths
from training import writers
from tools.plots import style as plot_style


def _save(fig, ax, path):
  """Legend, grid, tight layout; writes the PNG and frees the figure."""
  plt = plot_style.pyplot()
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  plot_style.save_figure(fig, path, dpi=120)
  plt.close(fig)
  return path


def per_position_figure(per_position, title, train_length=None):
  """Loss against position in the window, one line per evaluation length (not saved).

  Longer windows are darker; a long curve is averaged over `length // train_length` positions. A
  vertical line marks the training length: positions beyond it were never seen in training. The
  legend sits to the right of the axes.

  Args:
    per_position: {window length: mean loss at each position [length]}.
    title: the axes' title.
    train_length: the training length (config.data.max_length); None leaves it unmarked.

  Returns:
    The matplotlib figure.
  """
  plt = plot_style.pyplot()
  lengths = sorted(per_position)
  base = train_length or min(lengths)
  import matplotlib
  colors = matplotlib.colormaps['viridis'](np.linspace(0.85, 0.05, len(lengths)))  # short: light
  with plt.rc_context(plot_style.STYLE):
    fig, ax = plt.subplots(figsize=(9, 3.8), layout='constrained')
    for color, length in zip(colors, lengths):
      curve = np.asarray(per_position[length])
      k = max(1, length // base)  # smooth long curves over k positions
      smooth = np.convolve(curve, np.ones(k) / k, mode='valid')
      multiple = f'{length / train_length:g}x' if train_length else ''
      ax.plot(np.arange(len(smooth)) + k // 2, smooth, color=color,
              label=f'window {length}' + (f' ({multiple})' if multiple else ''))
    if train_length:
      ax.axvline(train_length, color='0.3', linestyle='--', linewidth=1.0)
      ax.text(train_length, 0.98, f' training length {train_length}', color='0.3', fontsize=9,
              ha='left', va='top', transform=ax.get_xaxis_transform())
    ax.set_xlabel('position in window (tokens)')
    ax.set_ylabel('loss (nats/token)')
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(loc='outside right upper', frameon=False)
  return fig


def _save_into(workdir, name, fig):
  """Saves `fig` as workdir/name (local or gs://), closes it; returns the path."""
  path = paths.join(workdir, name)
  plot_style.save_figure(fig, path)
  plot_style.pyplot().close(fig)
  return path


def plot_per_position(workdir, per_position, title, train_length=None):
  """Draws `per_position_figure` into workdir/extrapolation.png; returns its path."""
  return _save_into(workdir, 'extrapolation.png',
                    per_position_figure(per_position, title, train_length))


def draw_retrieval(ax, report, train_length=None, fontsize=8):
  """Draws a passkey retrieval grid on `ax`, as needle-in-a-haystack pictures do: lengths across,
  depths down (0% at the top: the key right after <bos>), each cell coloured on cividis (a
  colour-blind-safe map: dark blue 0 to yellow 1) and labelled with its accuracy in percent;
  returns the image (for a colour bar).

  Args:
    ax: matplotlib axes.
    report: {str(length): {str(depth): accuracy}} (`training.retrieval.retrieval`).
    train_length: the training length, named under its column; None leaves it unnamed.
    fontsize: of the percentages in the cells.
  """
  lengths = sorted(report, key=int)
  depths = list(report[lengths[0]])
  grid = np.array([[report[n][d] for n in lengths] for d in depths])  # [depths, lengths]
  image = ax.imshow(grid, cmap='cividis', vmin=0.0, vmax=1.0, aspect='auto',
                    interpolation='nearest')
  for (i, j), value in np.ndenumerate(grid):
    ax.text(j, i, f'{100 * value:.0f}', ha='center', va='center', fontsize=fontsize,
            color='black' if value > 0.55 else 'white')
  labels = [f'{n}\n{int(n) / train_length:g}x L' if train_length else n for n in lengths]
  ax.set_xticks(range(len(lengths)), labels)
  ax.set_yticks(range(len(depths)), [f'{float(d):.0%}' for d in depths])
  ax.tick_params(length=0)
  ax.spines[:].set_visible(False)
  return image


def retrieval_figure(report, title, train_length=None):
  """One run's passkey retrieval grid (`draw_retrieval`) with axis names and a colour bar (not
  saved); returns the matplotlib figure."""
  plt = plot_style.pyplot()
  with plt.rc_context(plot_style.STYLE):
    fig, ax = plt.subplots(figsize=(min(plot_style.WIDTH, 2.4 + 1.2 * len(report)), 4.8),
                           layout='constrained')
    image = draw_retrieval(ax, report, train_length)
    ax.set_xlabel('length (tokens)')
    ax.set_ylabel('depth of the key')
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label='retrieval accuracy', fraction=0.08, pad=0.03)
  return fig


def plot_retrieval(workdir, report, title, train_length=None):
  """Draws `retrieval_figure` into workdir/retrieval.png; returns its path."""
  return _save_into(workdir, 'retrieval.png', retrieval_figure(report, title, train_length))


def attention_batch(config, example, tokenizer):
  """The teacher-forced one-row batch of `example` for the run's arch, and the axis labels.

  Returns:
    (batch, query words, key words for 'self', key words for 'cross').
  """
  def words(ids):
    return [tokenizer.tokens[i] for i in ids]

  def row(ids):
    return np.asarray([ids], np.int32)  # [1, T]

  src, tgt = example['source_ids'], example['target_ids']
  batch_format = models.batch_format(config.model.arch)  # the rows the model reads
  if batch_format == 'source_target':
    src_in = src + [tokenizer.eos_id]
    tgt_in = [tokenizer.bos_id] + tgt
    batch = {'src_inputs': row(src_in), 'tgt_inputs': row(tgt_in)}
    return batch, words(tgt_in), words(tgt_in), words(src_in)
  seq = [tokenizer.bos_id] + src + [tokenizer.sep_id] + tgt + [tokenizer.eos_id]
  if batch_format == 'next_token':
    seq = seq[:-1]  # teacher forcing: the inputs stop before the last target
  return {'inputs': row(seq)}, words(seq), words(seq), None


def attention_figure(weights, rows, cols, title, cell=0.24, max_width=12.0):
  """Heat maps of one attention matrix per head, on one colour scale with one colorbar (not saved).

  Panels wrap into rows so that the figure stays within `max_width` inches; every panel names the
  key tokens across, the first of each row the query tokens down.

  Args:
    weights: [N, T, S] attention probabilities (heads, queries, keys).
    rows: the T query tokens.
    cols: the S key tokens.
    title: the figure's title (wrapped).
    cell: inches per token.
    max_width: the widest the figure gets before the panels wrap.

  Returns:
    The matplotlib figure.
  """
  import textwrap
  from matplotlib import colors as mcolors
  plt = plot_style.pyplot()
  weights = np.asarray(weights)
  heads = weights.shape[0]
  label_w = 0.07 * max(map(len, rows), default=1) + 0.3  # the query tokens left of each row
  label_h = 0.07 * max(map(len, cols), default=1) + 0.3  # the key tokens below each panel
  panel_w = cell * len(cols) + 0.2
  panel_h = cell * len(rows) + label_h + 0.3  # + the title
  ncols = max(1, min(heads, int((max_width - 1.2) // (panel_w + label_w))))
  nrows = -(-heads // ncols)  # ceil(heads / ncols)
  figsize = (ncols * (panel_w + label_w) + 1.2, nrows * panel_h + 0.7)
  # One scale for every head: a head that attends weakly looks weak, not rescaled to full colour.
  norm = mcolors.Normalize(0.0, max(float(weights.max()), 1e-6))
  with plt.rc_context(plot_style.STYLE):
    fig, axes = plt.subplots(nrows, ncols, squeeze=False, layout='constrained', figsize=figsize)
    for h, ax in enumerate(axes.flat):
      if h >= heads:
        ax.axis('off')
        continue
      image = ax.imshow(weights[h], cmap='viridis', norm=norm, aspect='equal',
                        interpolation='nearest')
      ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=8)
      first_in_row = h % ncols == 0
      ax.set_yticks(range(len(rows)), rows if first_in_row else [''] * len(rows), fontsize=8)
      ax.tick_params(length=0)
      ax.spines[:].set_visible(False)
      ax.set_title(f'head {h}', fontsize=9)
      if first_in_row:
        ax.set_ylabel('query')
      ax.set_xlabel('key')
    fig.colorbar(image, ax=axes, label='attention probability', fraction=0.04, pad=0.02)
    fig.suptitle('\n'.join(textwrap.wrap(title, 110)), fontsize=9)
  return fig


def plot_attention_maps(workdir, config, model, examples, tokenizer, layer=-1):
  """Heat maps of the last layer's attention for a few sentences, one panel per head.

  Self-attention (queries down, keys across) and, for encoder-decoder and RNN, cross-attention
  (target words down, source words across); for decoder-only also the target-rows x source-columns
  block of its self-attention, its alignment. Probabilities come from
  `layers.attention_xla.attention_weights` on the layer's own q/k. Each picture has one colour
  scale for all its heads (`attention_figure`). Writes attention_<i>_<kind>.png.

  Returns:
    The written paths.
  """
  plt = plot_style.pyplot()
  written = []
  for i, example in enumerate(examples):
    batch, q_words, self_words, cross_words = attention_batch(config, example, tokenizer)
    maps = dict(model.attention_weights(batch)[layer])  # {kind: [1, N, T, S]}
    panels = {}
    for kind, weights in maps.items():
      keys = self_words if kind == 'self' else cross_words
      panels[kind] = (np.asarray(weights[0]), q_words, keys)
    if models.batch_format(config.model.arch) == 'next_token':
      # Rows of the target tokens (from <sep>), columns of the source tokens (after <bos>).
      sep = q_words.index(tokenizer.tokens[tokenizer.sep_id])
      alignment = np.asarray(maps['self'][0])[:, sep:, 1:sep]  # [N, T - sep, sep - 1]
      panels['target_to_source'] = (alignment, q_words[sep:], q_words[1:sep])
    for kind, (weights, rows, cols) in panels.items():
      title = f'{config.model.arch}, layer {layer}, {kind}: {example["source"]}'
      fig = attention_figure(weights, rows, cols, title)
      path = paths.join(workdir, f'attention_{i}_{kind}.png')
      plot_style.save_figure(fig, path)
      plt.close(fig)
      written.append(path)
  return written


def plot_loss_curve(workdir):
  """Draws train and validation loss against step from metrics.jsonl into loss_curve.png."""
  plt = plot_style.pyplot()
  series = {}
  for row in writers.read_metrics(paths.join(workdir, 'metrics.jsonl')):
    series.setdefault(row['split'], []).append((row['step'], row['loss']))
  fig, ax = plt.subplots(figsize=(6, 4))
  for split, points in sorted(series.items()):
    steps, losses = zip(*points)
    ax.plot(steps, losses, label=split, marker='o' if split != 'train' else None)
  ax.set_xlabel('step')
  ax.set_ylabel('loss (nats/token)')
  plot_style.plain_log_axis(ax.yaxis)  # 2, 3, 4, 6 rather than 6x10^0
  ax.set_title(paths.basename(workdir))
  return _save(fig, ax, paths.join(workdir, 'loss_curve.png'))


def write_eval_outputs(workdir, result, run, splits, plot_attention=0):
  """Writes eval.json and the pictures of `training.evaluation.evaluate_run`'s (result, run).

  The extrapolation plot (with lengths), `plot_attention` attention maps of test sentences, and
  the loss curve; their paths are added to `result` (the plot paths drawn after eval.json is
  written stay out of the file). A passkey run's retrieval grid is drawn too.
  """
  overrides = ''.join(f', {k}={result[k]}' for k in ('xpos_block', 'position_ids')
                      if k in result and result[k] != 'sequential')
  if result.get('retrieval'):
    m = run.config.model
    scaling = result['rope_scaling']
    if scaling == 'as trained' and m.get('rope_scaling', 'none') != 'none':
      scaling = f'{m.rope_scaling}:{m.rope_scaling_factor:g} (as trained)'
    result['retrieval_plot'] = plot_retrieval(
        workdir, result['retrieval'],
        f'passkey retrieval: {m.position}, rope_scaling={scaling}{overrides}, '
        f'{result["retrieval_examples"]} examples a cell', train_length=run.config.data.max_length)
  if run.per_position:
    result['extrapolation_plot'] = plot_per_position(
        workdir, run.per_position,
        f'{run.config.model.position}, rope_scaling={result["rope_scaling"]}{overrides}',
        train_length=run.config.data.max_length)
  paths.write_text(paths.join(workdir, 'eval.json'), json.dumps(result, indent=2))
  if plot_attention:
    examples = pipeline.load_examples(run.config.data, 'test' if 'test' in splits else splits[-1])
    result['attention_plots'] = plot_attention_maps(
        workdir, run.config, run.model, examples[:plot_attention], run.tokenizer)
  result['loss_curve'] = plot_loss_curve(workdir)
  return result
