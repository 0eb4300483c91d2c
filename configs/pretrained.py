"""Fine-tuning a pretrained model (a workdir of `python -m tools.hf import`, or any decoder-only
run) on your own text, with its tokenizer: the model fields and tokenizer of the source run, the
text_lm task on your corpus, and `train.init_from` = the source.

Train: python train.py --config=configs/pretrained.py:from=WD,dir=CORPUS --workdir=FT
         [--config.model.rope_scaling=yarn --config.model.rope_scaling_factor=4
          --config.data.max_length=4096 ...]
       (CORPUS/train.txt, validation.txt, test.txt; `task=passkey` instead fine-tunes on passkey
       retrieval with filler from CORPUS/train.txt)
Eval:  python eval.py --workdir=FT --lengths=1,2,4
"""

import json
import os

from configs import default
from configs import text_lm

TASKS = ('text_lm', 'passkey')
# Fine-tuning settings: PI's (LLaMA 7B: 1,000 steps at 2e-5 after 20 warmup steps, constant).
STEPS, LEARNING_RATE, WARMUP = 1000, 2e-5, 20


def _source_config(source):
  path = os.path.join(source, 'config.json')
  if not os.path.isfile(path):
    raise ValueError(f'from={source!r} has no config.json; valid: the '
                      'workdir of tools.hf import or of a decoder_only train.py run')
  with open(path) as f:
    return json.load(f)


def get_config(arg=None):
  """`arg`: `from=WORKDIR` (required), `dir=CORPUS`, `task=text_lm|passkey`, `quick`."""
  args = default.parse_arg(arg)
  source = args.get('from')
  if not source or source is True:
    raise ValueError('it needs from=WORKDIR (the run to fine-tune), e.g. '
                      '--config=configs/pretrained.py:from=imported,dir=corpus')
  task = args.get('task', 'text_lm')
  if task not in TASKS:
    raise ValueError(f'task={task!r} unknown; valid: {list(TASKS)}')
  saved = _source_config(source)
  if saved.get('model', {}).get('arch') != 'decoder_only':
    raise ValueError(f'from={source!r} is not a decoder_only run')
  config = text_lm.get_config(arg)
  for name, value in saved['model'].items():
    if name in config.model:
      config.model[name] = tuple(value) if isinstance(value, list) else value
  source_data = saved.get('data', {})
  if not config.model.get('rope_original_length'):
    # A train.py run: its training length is the context a scaling switched on now refers to
    # (an import sets it to the checkpoint's max_position_embeddings).
    config.model.rope_original_length = source_data.get('max_length', config.data.max_length)
  if source_data.get('tokenizer'):
    config.data.tokenizer = source_data['tokenizer']
  config.data.max_length = source_data.get('max_length', config.data.max_length)
  config.data.task = task
  if task == 'passkey':  # one row per example, the loss on the value alone (configs/passkey.py)
    base = default.get_config()
    config.data.packing = base.data.packing
    config.train.loss_on = base.train.loss_on
  config.train.init_from = source
  config.train.update(steps=STEPS, learning_rate=LEARNING_RATE, warmup_steps=WARMUP,
                      schedule='constant')
  if 'quick' in args:
    config.train.update(steps=2, warmup_steps=0, batch_size=2, eval_every=2, checkpoint_every=2,
                        log_every=1, eval_batches=1)
  return config
