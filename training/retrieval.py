"""Passkey retrieval accuracy per length and depth (data.task=passkey): the needle-in-a-haystack
grid of eval.py, `{"<length in tokens>": {"<depth>": accuracy}}`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from data import passkey
from data import passkey_text
from training import distributed
from training import extrapolation

DEFAULT_EXAMPLES = 100  # examples per (length, depth) cell


def depth_key(depth):
  """The report's key of a depth: '0.0', '0.1', ..., '1.0'."""
  return f'{depth:.1f}'


def _examples(spec, tokenizer, length, depth, count):
  """(prompt ids, value ids) of `count` examples: the toy task's words encoded, or the pass key
  in your text (data.tokenizer: `data.passkey_text`)."""
  if spec.tokenizer:
    return passkey_text.retrieval_examples(spec, length, depth, count)
  return [(tokenizer.encode(' '.join(prompt)), tokenizer.encode(' '.join(value)))
          for prompt, value in passkey.retrieval_examples(spec, length, depth, count)]


def _rows(spec, tokenizer, length, depths, count):
  """([cells x count, length] inputs, [cells x count, k] value ids) of every depth's examples,
  depth after depth; a value of fewer than k tokens (the key's tokens vary under some tokenizers)
  is left-padded with -1, which no prediction equals."""
  inputs, values = [], []
  for depth in depths:
    for prompt, value in _examples(spec, tokenizer, length, depth, count):
      inputs.append(passkey.row(prompt, value, length, bos=tokenizer.bos_id,
                                pad=tokenizer.pad_id)['inputs'])
      values.append(list(value))
  k = max(len(v) for v in values)
  return np.stack(inputs), np.asarray([[-1] * (k - len(v)) + v for v in values], np.int32)


def _correct(model, inputs, values, batch_size, ids_of=None, first=0):
  """[rows] bool: whether the greedy prediction of every value token is right (teacher forcing:
  all right exactly when greedy decoding writes the value). The rows are numbered from `first`;
  `ids_of(row numbers)` gives their position ids (None: 0..T-1)."""
  k = values.shape[1]

  @jax.jit
  def predict(batch, positions):
    features = {'inputs': batch} if positions is None else {'inputs': batch,
                                                            'positions': positions}
    logits = model(features)  # [B, T, V]
    return jnp.argmax(logits[:, -k:], -1)  # the value's positions end every row

  out = []
  for i in range(0, len(inputs), batch_size):
    chunk = inputs[i:i + batch_size]
    pos = None if ids_of is None else ids_of(np.arange(first + i, first + i + len(chunk)))
    pad = batch_size - len(chunk)  # fixed shapes: one compilation per length
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
      pos = None if pos is None else np.concatenate([pos, np.repeat(pos[-1:], pad, 0)])
    out.append(np.asarray(predict(chunk, pos))[:batch_size - pad])
  predicted = np.concatenate(out) if out else np.zeros((0, k), np.int32)
  return np.all((predicted == values) | (values < 0), axis=1)


def retrieval(config, model, tokenizer, lengths, depths=passkey.EVAL_DEPTHS,
              examples=DEFAULT_EXAMPLES, position_ids='sequential'):
  """Retrieval accuracy of `model` at each length (tokens) and depth.

  Every process scores its share of each length's examples; the shares are gathered, so every
  process holds the whole report. The examples are the same for every run with the same
  data.passkey_values and data.passkey_value_tokens (`data.passkey.retrieval_examples`).
  `position_ids` (`training.extrapolation.POSITION_IDS`): the rows' ids; random and spaced ids, for
  a randomized-positions run, are drawn per row as for the stream windows.

  Returns:
    {str(length): {depth_key(depth): share of the examples whose value is predicted}}.
  """
  spec = passkey.spec_from_config(config.data)
  report = {}
  for length in lengths:
    inputs, values = _rows(spec, tokenizer, length, depths, examples)
    start, stop = distributed.process_share(len(inputs))
    ids_of = None if position_ids == 'sequential' else functools.partial(
        extrapolation.window_position_ids, position_ids, length=length,
        max_position=config.model.random_positions_max)
    correct = _correct(model, inputs[start:stop], values[start:stop], max(1, 8192 // length),
                       ids_of, first=start)
    correct = distributed.gather_rows(correct.astype(np.float32)).reshape(len(depths), examples)
    report[str(length)] = {depth_key(d): float(np.mean(c, dtype=np.float64))
                           for d, c in zip(depths, correct)}
  return report


def summary_lines(report):
  """The report as text: a header of depths, then one line per length of the share of pass keys
  retrieved (%); none for an empty report (a run that is not a passkey run)."""
  if not report:
    return []
  depths = list(next(iter(report.values())))
  lines = ['pass keys retrieved (%), by the depth of the key in the text:',
           f'{"depth":>16}: ' + ' '.join(f'{float(d):>5.0%}' for d in depths)]
  for length, row in report.items():
    lines.append(f'{"length " + length:>16}: ' + ' '.join(f'{100 * a:4.0f}%' for a in row.values()))
  return lines


def is_passkey(config):
  """Whether the run was trained on the passkey task (eval.py then reports retrieval)."""
  return config.data.get('task') == passkey.TASK
