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
import ml_collections
from flax import nnx

from data import pipeline
from models import decoding
import train

_WORKDIR = flags.DEFINE_string('workdir', None, 'A train.py workdir.')
_SPLIT = flags.DEFINE_list('split', ['validation', 'test'], 'Splits to evaluate.')
_MAX_EXAMPLES = flags.DEFINE_integer('max_examples', 0,
                                     'Translate at most this many examples per split (0 = all).')


def load_run(workdir):
  """Returns (config, graphdef, params, step) of the newest checkpoint in `workdir`."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'eval: {workdir} has no config.json; is it a train.py workdir?')
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  mngr = train.checkpoint_manager(workdir, config)
  if mngr.latest_step() is None:
    raise FileNotFoundError(f'eval: no checkpoint in {os.path.join(workdir, "checkpoints")}')
  tokenizer = pipeline.get_tokenizer(config.data)
  graphdef, _, state = train.create_state(config, tokenizer.vocab_size)
  state, _ = train.restore_state(mngr, state)
  mngr.close()
  return config, graphdef, state['params'], int(state['step'])


def translate(config, model, examples, tokenizer):
  """Greedy translation of `examples`; returns exact match, token accuracy and a few samples."""
  prompts = [[tokenizer.bos_id] + e['source_ids'] + [tokenizer.sep_id] for e in examples]
  refs = [e['target_ids'] for e in examples]
  length = config.data.max_length
  max_new = max(len(r) for r in refs) + 1
  hyps = decoding.greedy_translate(model, prompts, length=length, max_new=max_new,
                                   eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  exact = sum(h == r for h, r in zip(hyps, refs))
  # Token accuracy: reference positions (and the final eos) predicted correctly at the same index.
  correct = total = 0
  for h, r in zip(hyps, refs):
    r_eos, h_eos = r + [tokenizer.eos_id], h + [tokenizer.eos_id]
    correct += sum(a == b for a, b in zip(h_eos, r_eos))
    total += len(r_eos)
  samples = [{'source': e['source'], 'reference': e['target'], 'output': tokenizer.decode(h)}
             for e, h in zip(examples[:5], hyps[:5])]
  return {'exact_match': exact / len(refs), 'token_accuracy': correct / total, 'n': len(refs),
          'samples': samples}


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
  ax.legend()
  ax.grid(alpha=0.3)
  path = os.path.join(workdir, 'loss_curve.png')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def evaluate_run(workdir, splits, max_examples=0):
  """Evaluates the newest checkpoint in `workdir`; returns (and writes) the eval.json dict."""
  config, graphdef, params, step = load_run(workdir)
  tokenizer = pipeline.get_tokenizer(config.data)
  eval_fn = jax.jit(functools.partial(train.eval_step, graphdef))
  model = nnx.merge(graphdef, params)
  result = {'step': step, 'loss': {}, 'perplexity': {}, 'accuracy': {}, 'translation': {}}
  for split in splits:
    m = train.evaluate(eval_fn, params, config, split, 0)
    result['loss'][split] = m['loss']
    result['perplexity'][split] = math.exp(min(m['loss'], 50.0))
    result['accuracy'][split] = m['accuracy']
    examples = pipeline.load_examples(config.data, split)
    if max_examples:
      examples = examples[:max_examples]
    result['translation'][split] = translate(config, model, examples, tokenizer)
  main_split = 'test' if 'test' in splits else splits[-1]
  result['exact_match'] = result['translation'][main_split]['exact_match']
  result['token_accuracy'] = result['translation'][main_split]['token_accuracy']
  with open(os.path.join(workdir, 'eval.json'), 'w') as f:
    json.dump(result, f, indent=2)
  result['loss_curve'] = plot_loss_curve(workdir)
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError('Too many command-line arguments.')
  logging.set_verbosity(logging.WARNING)  # Orbax logs every file it renames at INFO
  if not _WORKDIR.value:
    print('eval: --workdir is required', file=sys.stderr)
    sys.exit(2)
  try:
    result = evaluate_run(_WORKDIR.value, _SPLIT.value, _MAX_EXAMPLES.value)
  except FileNotFoundError as e:
    print(str(e), file=sys.stderr)
    sys.exit(1)
  for split in _SPLIT.value:
    t = result['translation'][split]
    print(f'{split}: loss {result["loss"][split]:.4f}  ppl {result["perplexity"][split]:.3f}  '
          f'exact_match {t["exact_match"]:.4f}  token_accuracy {t["token_accuracy"]:.4f}  '
          f'(n={t["n"]})')
  print(f'wrote {os.path.join(_WORKDIR.value, "eval.json")} and {result["loss_curve"]}')


if __name__ == '__main__':
  app.run(main)
