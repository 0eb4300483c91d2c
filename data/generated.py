"""What the locally generated TFDS tasks (data/passkey.py, data/synthetic.py) share: preparing a
builder's dataset and its word tokenizer once, under a file lock, and reading a split back."""

import fcntl
import os

import tensorflow_datasets as tfds

from data import preparation
from data import tokenizer as tokenizer_lib

TOKENIZER_FILE = 'tokenizer.json'


def prepare(data_dir: str, lock_name: str, folder: str, make_builder, words) -> str:
  """Generates a dataset into `folder` with `make_builder()` and saves the tokenizer of `words`
  beside it, unless already there; returns `folder`. tokenizer.json is written last: it marks a
  complete dataset. Concurrent first calls are serialised by the file `lock_name` in data_dir."""
  tokenizer_path = os.path.join(folder, TOKENIZER_FILE)
  if os.path.exists(tokenizer_path):
    return folder
  os.makedirs(data_dir, exist_ok=True)
  with open(os.path.join(data_dir, lock_name), 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not os.path.exists(tokenizer_path):  # another process may have finished meanwhile
      builder = make_builder()
      assert os.fspath(builder.data_dir) == folder, builder.data_dir
      tfds.disable_progress_bar()  # The bars would flood the training logs.
      with preparation.preparing(folder, 'the dataset'):
        builder.download_and_prepare(file_format='array_record')
        tokenizer_lib.Tokenizer.from_words(words).save(tokenizer_path)
  return folder


def load_tokenizer(folder: str) -> tokenizer_lib.Tokenizer:
  return tokenizer_lib.Tokenizer.load(os.path.join(folder, TOKENIZER_FILE))


def read_records(folder: str, split: str) -> list[dict]:
  """Every record of a prepared split, in generation order (one bulk read, no TensorFlow)."""
  source = tfds.builder_from_directory(folder).as_data_source(split=split)
  return source.__getitems__(range(len(source)))
