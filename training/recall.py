"""Associative recall accuracy of an mqar run (data.task=mqar) by number of pairs and by key-query
distance: eval.json's `recall`, `{"by_pairs": {"<pairs>": accuracy}, "by_distance":
{"<lo>-<hi>": accuracy}}` (accuracy: the share of asked values predicted, teacher-forced)."""

import jax
import jax.numpy as jnp
import numpy as np

from data import synthetic
from training import distributed

DEFAULT_EXAMPLES = 200  # rows per number of pairs


def is_mqar(config):
  """Whether the run was trained on the mqar task (eval.py then reports `recall`)."""
  return config.data.get('task') == 'mqar'


def pair_levels(spec):
  """The numbers of pairs the report asks at: P/4, P/2, P and 2P, where a row of the run's length
  and key vocabulary holds them (each with min(queries, pairs) queries)."""
  levels = sorted({max(1, spec.pairs // 4), max(1, spec.pairs // 2), spec.pairs, 2 * spec.pairs})
  return [p for p in levels if p <= spec.key_vocab
          and synthetic.min_length('mqar', p, min(spec.queried, p)) <= spec.length]


def _rows(tokenizer, examples, length):
  """([rows, L] inputs, [rows, L] targets, [rows, L] weights) of (words, scored) examples."""
  rows = [synthetic.row(np.asarray(tokenizer.encode(' '.join(words)), np.int32), scored, length)
          for words, scored in examples]
  return tuple(np.stack([r[name] for r in rows]) for name in ('inputs', 'targets', 'weights'))


def _predictions(model, inputs, batch_size):
  """[rows, L] greedy predictions of every position (teacher forcing)."""

  @jax.jit
  def predict(batch):
    return jnp.argmax(model({'inputs': batch}), -1)  # [B, T]

  out = []
  for i in range(0, len(inputs), batch_size):
    chunk = inputs[i:i + batch_size]
    pad = batch_size - len(chunk)  # fixed shapes: one compilation
    if pad:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
    out.append(np.asarray(predict(chunk))[:batch_size - pad])
  return np.concatenate(out) if out else np.zeros((0, inputs.shape[1]), np.int32)


def _correct(model, inputs, targets):
  """[rows, L] float32: 1 where this process's share of the rows is predicted right, gathered."""
  start, stop = distributed.process_share(len(inputs))
  right = _predictions(model, inputs[start:stop], max(1, 8192 // inputs.shape[1]))
  right = (right == targets[start:stop]).astype(np.float32)
  return distributed.gather_rows(right).reshape(targets.shape)


def distance_bucket(distance: int) -> str:
  """The report's key of a key-query distance: powers of two, '2-3', '4-7', '8-15', ..."""
  lo = 1 << (max(int(distance), 1).bit_length() - 1)
  return f'{lo}-{2 * lo - 1}'


def recall(config, model, tokenizer, examples=DEFAULT_EXAMPLES):
  """The recall report of `model`: accuracy at each of `pair_levels` (`examples` rows each, the
  same rows for every run of the same setting) and, over the test split, by key-query distance.

  Every process scores its share of the rows; the shares are gathered, so every process holds the
  whole report.
  """
  spec = synthetic.spec_from_config(config.data)
  by_pairs = {}
  for pairs in pair_levels(spec):
    inputs, targets, weights = _rows(tokenizer, synthetic.grid_examples(spec, pairs, examples),
                                     spec.length)
    right = _correct(model, inputs, targets)
    by_pairs[str(pairs)] = float(np.sum(right * weights) / np.sum(weights))
  test = [(words.split(), [int(i) for i in scored.split()])
          for words, scored in synthetic.read_split(spec, 'test')]
  inputs, targets, _ = _rows(tokenizer, test, spec.length)
  right = _correct(model, inputs, targets)
  sums = {}
  for row, (words, scored) in enumerate(test):
    for index in scored:
      key = distance_bucket(synthetic.key_query_distance(words, index))
      hit, count = sums.get(key, (0.0, 0))
      sums[key] = (hit + right[row, index], count + 1)
  by_distance = {key: float(hit / count) for key, (hit, count) in
                 sorted(sums.items(), key=lambda item: int(item[0].split('-')[0]))}
  return {'by_pairs': by_pairs, 'by_distance': by_distance, 'examples': examples}


def summary_lines(report):
  """The report as two text lines, each value the share of queries recalled in %; none for an
  empty report."""
  if not report:
    return []
  return ['recall by key-value pairs in the context: ' + '  '.join(
              f'{p} {"pair" if p == "1" else "pairs"} {100 * a:.1f}%'
              for p, a in report['by_pairs'].items()),
          'recall by key-query distance in tokens: ' + '  '.join(
              f'{d}: {100 * a:.1f}%' for d, a in report['by_distance'].items())]
