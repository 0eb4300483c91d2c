"""Passkey retrieval accuracy per length and depth (data.task=passkey): the needle-in-a-haystack
grid of eval.py, `{"<length in tokens>": {"<depth>": accuracy}}`."""

import jax
import jax.numpy as jnp
import numpy as np

from data import passkey
from training import distributed

DEFAULT_EXAMPLES = 100  # examples per (length, depth) cell


def depth_key(depth):
  """The report's key of a depth: '0.0', '0.1', ..., '1.0'."""
  return f'{depth:.1f}'


def _rows(spec, tokenizer, length, depths, count):
  """([cells x count, length] inputs, [cells x count, k] value ids) of every depth's examples,
  depth after depth."""
  inputs, values = [], []
  for depth in depths:
    for prompt, value in passkey.retrieval_examples(spec, length, depth, count):
      value_ids = tokenizer.encode(' '.join(value))
      inputs.append(passkey.row(tokenizer.encode(' '.join(prompt)), value_ids, length)['inputs'])
      values.append(value_ids)
  return np.stack(inputs), np.asarray(values, np.int32)


def _correct(model, inputs, values, batch_size):
  """[rows] bool: whether the greedy prediction of every value token is right (teacher forcing:
  all right exactly when greedy decoding writes the value)."""
  k = values.shape[1]

  @jax.jit
  def predict(batch):
    logits = model({'inputs': batch})  # [B, T, V]
    return jnp.argmax(logits[:, -k:], -1)  # the value's positions end every row

  out = []
  for i in range(0, len(inputs), batch_size):
    chunk = inputs[i:i + batch_size]
    pad = batch_size - len(chunk)  # fixed shapes: one compilation per length
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
    out.append(np.asarray(predict(chunk))[:batch_size - pad])
  predicted = np.concatenate(out) if out else np.zeros((0, k), np.int32)
  return np.all(predicted == values, axis=1)


def retrieval(config, model, tokenizer, lengths, depths=passkey.EVAL_DEPTHS,
              examples=DEFAULT_EXAMPLES):
  """Retrieval accuracy of `model` at each length (tokens) and depth.

  Every process scores its share of each length's examples; the shares are gathered, so every
  process holds the whole report. The examples are the same for every run with the same
  data.passkey_values and data.passkey_value_tokens (`data.passkey.retrieval_examples`).

  Returns:
    {str(length): {depth_key(depth): share of the examples whose value is predicted}}.
  """
  spec = passkey.spec_from_config(config.data)
  report = {}
  for length in lengths:
    inputs, values = _rows(spec, tokenizer, length, depths, examples)
    start, stop = distributed.process_share(len(inputs))
    correct = _correct(model, inputs[start:stop], values[start:stop], max(1, 8192 // length))
    correct = distributed.gather_rows(correct.astype(np.float32)).reshape(len(depths), examples)
    report[str(length)] = {depth_key(d): float(np.mean(c, dtype=np.float64))
                           for d, c in zip(depths, correct)}
  return report


def summary_lines(report):
  """The report as text: a header of depths, then one line per length of accuracies (%); none
  for an empty report (a run that is not a passkey run)."""
  if not report:
    return []
  depths = list(next(iter(report.values())))
  lines = [f'{"retrieval  depth":>16}: ' + ' '.join(f'{float(d):>4.0%}' for d in depths)]
  for length, row in report.items():
    lines.append(f'{"length " + length:>16}: ' + ' '.join(f'{100 * a:4.0f}' for a in row.values()))
  return lines


def is_passkey(config):
  """Whether the run was trained on the passkey task (eval.py then reports retrieval)."""
  return config.data.get('task') == passkey.TASK
