"""Decoder-only language model on your own text files (one document per line), with the length
extrapolation harness over the test file's token stream.

Train: python train.py --config=configs/text_lm.py:dir=CORPUS --workdir=DIR
       (CORPUS/train.txt, validation.txt, test.txt), or --config.data.files.train=PATH and so on
Eval:  python eval.py --workdir=DIR --lengths=1,2,4
"""

import os

from configs import default


def get_config(arg=None):
  """`arg` as in configs/default.py (`quick`, `size=NAME`), and `dir=CORPUS`: CORPUS/{split}.txt."""
  args = default.parse_arg(arg)
  config = default.get_config(arg)
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  config.data.task = 'text_lm'
  corpus = args.get('dir')
  if corpus:
    for split in ('train', 'validation', 'test'):
      config.data.files[split] = os.path.join(corpus, f'{split}.txt')
  config.data.vocab_size = 8000  # SentencePiece pieces
  config.data.packing = 'stream'  # documents concatenated and cut into rows, as in LM studies
  config.data.max_length = 128
  config.train.loss_on = 'all'  # every token (a document has no source side)
  return config
