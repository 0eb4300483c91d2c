"""SentencePiece tokenizer of a user corpus, with the toy tokenizer's special ids and interface."""

import io
import os
import random

import sentencepiece as spm

from data import tokenizer as tokenizer_lib

SHARED_FILE = 'spm.model'
SOURCE_FILE, TARGET_FILE = 'spm_source.model', 'spm_target.model'
NUM_SPECIAL = len(tokenizer_lib.SPECIAL_TOKENS)
MAX_SENTENCES = 2_000_000  # lines the vocabulary is learnt from (a sample of larger corpora)
# Fixed, not the host's core count: the trainer's result depends on how many threads split the
# work (measured: 1, 4 and 16 threads give three different models of one corpus), and every host
# of a multi-host run prepares its own copy, which must be the same.
TRAINER_THREADS = 8


class TrainingError(ValueError):
  """SentencePiece could not build the vocabulary (e.g. vocab_size beyond what the text allows)."""


def train(sentences, vocab_size: int) -> bytes:
  """Trains a unigram SentencePiece model on `sentences`; returns the serialised model.

  The special pieces take the ids of `data.tokenizer` (pad 0, bos 1, eos 2, sep 3, mask 4, unk 5),
  so the pipeline, the models' `SpecialIds` and the decoders treat both tokenizers alike. `<sep>`
  and `<mask>` are control symbols: a literal "<sep>" in the text is ordinary characters.

  Args:
    sentences: an iterable of str (lines of the training split).
    vocab_size: pieces in the model, the 6 special ones included.

  Raises:
    TrainingError: SentencePiece's own reason, in one line.
  """
  sentences = list(sentences)
  if len(sentences) > MAX_SENTENCES:
    # A seeded sample, not the trainer's own shuffle: every host of a multi-host run prepares its
    # own copy, and all must get the same vocabulary.
    sentences = random.Random(0).sample(sentences, MAX_SENTENCES)
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
        model_type='unigram', pad_id=tokenizer_lib.PAD, bos_id=tokenizer_lib.BOS,
        eos_id=tokenizer_lib.EOS, unk_id=tokenizer_lib.UNK,
        pad_piece='<pad>', bos_piece='<bos>', eos_piece='<eos>', unk_piece='<unk>',
        control_symbols=['<sep>', '<mask>'],
        # One document per line can be long: the default (4,192 bytes) would leave long lines out
        # of the vocabulary's statistics.
        max_sentence_length=1 << 16, shuffle_input_sentence=False,
        num_threads=TRAINER_THREADS, minloglevel=2)
  except RuntimeError as e:
    # 'INTERNAL: src/trainer_interface.cc(744) [...] Vocabulary size too high (5000). Please ...'
    raise TrainingError(str(e).rsplit('] ', 1)[-1].strip()) from None
  return model.getvalue()


class SentencePieceTokenizer:
  """One SentencePiece model (shared) or two (source, target) behind the `Tokenizer` interface.

  With two models the ids are one space: the 6 specials, the source model's other pieces, then the
  target model's other pieces (offset), so V = V_source + V_target - 6 and no id means two things
  (a decoder-only stream holds both sides; a model with one embedding table reads either).
  """

  pad_id, bos_id, eos_id = tokenizer_lib.PAD, tokenizer_lib.BOS, tokenizer_lib.EOS
  sep_id, mask_id, unk_id = tokenizer_lib.SEP, tokenizer_lib.MASK, tokenizer_lib.UNK

  def __init__(self, source_model: bytes, target_model: bytes | None = None):
    """Loads serialised models: one shared, or source and target."""
    self._source = spm.SentencePieceProcessor(model_proto=source_model)
    self._target = (self._source if target_model is None
                    else spm.SentencePieceProcessor(model_proto=target_model))
    self.shared = target_model is None
    for sp in {id(self._source): self._source, id(self._target): self._target}.values():
      pieces = tuple(sp.id_to_piece(i) for i in range(NUM_SPECIAL))
      if pieces != tokenizer_lib.SPECIAL_TOKENS:
        raise ValueError(f'SentencePiece model specials {pieces} are not '
                         f'{tokenizer_lib.SPECIAL_TOKENS}: not a model trained by `train`')
    # Target-model word ids are shifted past the source model's pieces (0 when shared).
    self._offset = 0 if self.shared else self._source.get_piece_size() - NUM_SPECIAL
    self.tokens = [self._source.id_to_piece(i) for i in range(self._source.get_piece_size())]
    if not self.shared:
      self.tokens += [self._target.id_to_piece(i)
                      for i in range(NUM_SPECIAL, self._target.get_piece_size())]

  @property
  def vocab_size(self) -> int:
    return len(self.tokens)

  def encode_source(self, text: str) -> list[int]:
    """The ids of a source sentence (or of a document, with a shared model)."""
    return self._source.encode(text)

  def encode_target(self, text: str) -> list[int]:
    """The ids of a target sentence, in the joint id space."""
    ids = self._target.encode(text)
    if self._offset:
      ids = [i + self._offset if i >= NUM_SPECIAL else i for i in ids]
    return ids

  def _model_and_id(self, i):
    if i < NUM_SPECIAL or i < self._source.get_piece_size():
      return self._source, i
    return self._target, i - self._offset

  def decode(self, ids, *, stop_at_eos: bool = False, skip_special: bool = False) -> str:
    """Returns the detokenized text of ids (SentencePiece's own detokenization).

    Args:
      ids: a sequence of ints (list or 1-D array) in the joint id space.
      stop_at_eos: drop the first <eos> and everything after it.
      skip_special: drop every special token (<unk> included), not only <pad>.

    Returns:
      The text: runs of word pieces detokenized by their model, specials other than <pad> and
      <unk> written as their piece (e.g. '<sep>'), joined by spaces. <unk> decodes as ' ⁇ '.
    """
    parts, run, run_model = [], [], None

    def flush():
      if run:
        parts.append(run_model.decode(run))
        run.clear()

    for i in ids:
      i = int(i)
      if i == self.eos_id and stop_at_eos:
        break
      if i == self.pad_id or (skip_special and i < NUM_SPECIAL):
        continue
      if i < NUM_SPECIAL and i != self.unk_id:
        flush()
        parts.append(self.tokens[i])
        continue
      model, local = self._model_and_id(i)
      if model is not run_model:
        flush()
        run_model = model
      run.append(local)
    flush()
    return ' '.join(p.strip() for p in parts if p.strip())

  def save(self, directory: str) -> None:
    """Writes the model file(s) into directory: spm.model, or spm_source/spm_target.model."""
    names = [SHARED_FILE] if self.shared else [SOURCE_FILE, TARGET_FILE]
    for name, sp in zip(names, (self._source, self._target)):
      with open(os.path.join(directory, name), 'wb') as f:
        f.write(sp.serialized_model_proto())

  @classmethod
  def load(cls, directory: str) -> 'SentencePieceTokenizer':
    """Reads the model file(s) written by save."""
    def read(name):
      with open(os.path.join(directory, name), 'rb') as f:
        return f.read()
    if os.path.exists(os.path.join(directory, SHARED_FILE)):
      return cls(read(SHARED_FILE))
    return cls(read(SOURCE_FILE), read(TARGET_FILE))
