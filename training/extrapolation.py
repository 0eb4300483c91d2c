"""Length extrapolation: the loss of a token stream in windows of multiples of the training
length."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from data import pipeline
from layers import positions as positions_lib
from training import distributed

# eval.py --position_ids: the position ids a window is evaluated at. sequential: 0..T-1 (as every
# model trains, and as a randomized-positions model never saw them); random: per window, T sorted
# distinct draws from [0, N), N = model.random_positions_max, as that model trains (Ruoss et al.
# 2023 evaluate so); spaced: round(p·N/T), spread evenly over [0, N).
POSITION_IDS = ('sequential', 'random', 'spaced')


def check_position_ids(config, kind, lengths):
  """ValueError (one line) for --position_ids a run cannot take: random or spaced ids need a
  randomized-positions run (model.random_positions_max = N) and lengths of at most N."""
  if kind not in POSITION_IDS:
    raise ValueError(f'--position_ids={kind!r} is not valid; valid values: '
                     f'{", ".join(POSITION_IDS)}')
  if kind == 'sequential':
    return
  n = config.model.get('random_positions_max', 0)
  if not n:
    raise ValueError(f'--position_ids={kind} draws ids from [0, model.random_positions_max), '
                     'which is 0 (off) for this run; valid values: sequential')
  longest = max((int(m * config.data.max_length) for m in lengths), default=0)
  if longest > n:
    raise ValueError(f'--position_ids={kind}: a window of {longest} tokens needs that many ids '
                     f'of model.random_positions_max={n}; valid: --lengths up to '
                     f'{n / config.data.max_length:g}')


def window_position_ids(kind, windows, length, max_position, seed=0):
  """`[W, T]` position ids (`POSITION_IDS`) of the windows numbered `windows` `[W]`, T tokens each,
  or None for sequential. A window's random ids are drawn from its own key (the seed folded with
  its number): the same whatever the batch or the process evaluating it."""
  if kind == 'sequential':
    return None
  windows = np.asarray(windows)
  if kind == 'spaced':
    ids = np.round(np.arange(length) * max_position / length).astype(np.int32)
    return np.broadcast_to(ids, (len(windows), length))
  keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), jnp.asarray(windows))
  one = lambda key: positions_lib.random_positions(key, jnp.arange(length)[None], max_position)[0]
  return np.asarray(jax.vmap(one)(keys))


def _window_losses(model, tokens, in_target, starts, length, batch_size, ids_of=None, first=0):
  """Per-position losses of windows `tokens[start:start + length + 1]`, numbered from `first`,
  at the position ids `ids_of(window numbers)` gives (None: 0..L-1), drawn a batch at a time.

  Returns:
    (ce, target) `[num_windows, length]`: next-token cross-entropy, and 1 where the predicted token
    is on the target side.
  """
  @jax.jit
  def forward(inputs, targets, positions):
    batch = {'inputs': inputs} if positions is None else {'inputs': inputs, 'positions': positions}
    logits = model(batch)  # [B, L, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, L]

  idx = np.asarray(starts)[:, None] + np.arange(length + 1)[None]  # [W, L + 1]
  windows, masks = tokens[idx], in_target[idx]
  ce = []
  for i in range(0, len(windows), batch_size):
    chunk = windows[i:i + batch_size]
    pos = None if ids_of is None else ids_of(np.arange(first + i, first + i + len(chunk)))
    pad = batch_size - len(chunk)  # fixed shapes: one compilation per length
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
      pos = None if pos is None else np.concatenate([pos, np.repeat(pos[-1:], pad, 0)])
    ce.append(np.asarray(forward(chunk[:, :-1], chunk[:, 1:], pos))[:batch_size - pad])
  return np.concatenate(ce), masks[:, 1:]


def _shared_window_losses(model, tokens, in_target, starts, length, batch_size, ids_of=None):
  """`_window_losses` of this process's share of the windows, gathered from every process."""
  start, stop = distributed.process_share(len(starts))
  if stop > start:
    ce, tgt = _window_losses(model, tokens, in_target, starts[start:stop], length, batch_size,
                             ids_of, first=start)
  else:
    ce, tgt = np.zeros((0, length), np.float32), np.zeros((0, length), in_target.dtype)
  return distributed.gather_rows(ce), distributed.gather_rows(tgt)


def extrapolate(config, model, multiples, modes, stride, split, position_ids='sequential',
                max_tokens=0):
  """Loss of a stream at `multiple x max_length` tokens per window (attention across pairs).

  non_overlapping scores every position of disjoint windows; sliding moves the window by
  `stride x length` and scores only the positions it has not scored before, so each has at least
  `(1 - stride) x length` tokens of context (except in the first window). `position_ids`
  (`POSITION_IDS`) are the ids each window is evaluated at; random ids are drawn per window from
  a fixed seed (the same for every run and process). `max_tokens`: the first this many tokens of
  the stream alone (0 = all).

  Returns:
    (rows for eval.json, {length: mean loss per window position} of the non-overlapping windows).
  """
  check_position_ids(config, position_ids, multiples)
  tokens, in_target = pipeline.stream_tokens(config.data, split)
  if max_tokens:
    tokens, in_target = tokens[:max_tokens], in_target[:max_tokens]
  rows, per_position = [], {}
  for multiple in multiples:
    length = int(multiple * config.data.max_length)
    batch_size = max(1, 8192 // length)
    ids_of = None if position_ids == 'sequential' else functools.partial(
        window_position_ids, position_ids, length=length,
        max_position=config.model.get('random_positions_max', 0))
    for mode in modes:
      if mode == 'non_overlapping':
        starts = np.arange(0, len(tokens) - length, length)
        ce, tgt = _shared_window_losses(model, tokens, in_target, starts, length, batch_size,
                                        ids_of)
        scored = np.ones_like(ce, bool)
        per_position[length] = ce.mean(0)
      elif mode == 'sliding':
        step = max(1, int(stride * length))
        starts = np.arange(0, len(tokens) - length, step)
        ce, tgt = _shared_window_losses(model, tokens, in_target, starts, length, batch_size,
                                        ids_of)
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
