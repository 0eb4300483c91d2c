"""Length extrapolation: the loss of a token stream in windows of multiples of the training length."""

import math

import jax
import numpy as np
import optax

from data import pipeline
from training import distributed


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
  start, stop = distributed.process_share(len(starts))
  if stop > start:
    ce, tgt = _window_losses(model, tokens, in_target, starts[start:stop], length, batch_size)
  else:
    ce, tgt = np.zeros((0, length), np.float32), np.zeros((0, length), in_target.dtype)
  return distributed.gather_rows(ce), distributed.gather_rows(tgt)


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
