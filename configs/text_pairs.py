"""Encoder-decoder translation on your own TSV files (source<TAB>target, one pair per line).

Train: python train.py --config=configs/text_pairs.py:dir=CORPUS --workdir=DIR
       (CORPUS/train.tsv, validation.tsv, test.tsv), or name each file:
       --config.data.files.train=PATH --config.data.files.validation=PATH
       --config.data.files.test=PATH
Eval:  python eval.py --workdir=DIR
"""

import os

from configs import default


def get_config(arg=None):
  """`arg` as in configs/default.py (`quick`, `size=NAME`), and `dir=CORPUS`: CORPUS/{split}.tsv."""
  args = default.parse_arg(arg)
  config = default.get_config(arg)
  config.model.arch = 'encoder_decoder'
  config.data.task = 'text_pairs'
  corpus = args.get('dir')
  if corpus:
    for split in ('train', 'validation', 'test'):
      config.data.files[split] = os.path.join(corpus, f'{split}.tsv')
  config.data.vocab_size = 8000  # SentencePiece pieces (a few thousand suit 100k+ pairs)
  config.data.shared_vocab = True  # one model for both languages, with one shared embedding
  config.data.packing = 'segments'  # sentences of many lengths: pack them, attention per pair
  config.data.max_length = 128
  return config
