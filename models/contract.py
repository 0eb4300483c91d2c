"""What an architecture declares: its Transformer stacks, its batch format, what it decodes and
which tasks, packings and options it takes.

Each class in `models.ARCHS` carries one `ArchSpec` as its `spec` attribute. Validation, accounting,
evaluation, translation, the ahead-of-time compiles and the tools read these declarations
(`models.spec`, `models.archs_where`); no module outside models/ compares `config.model.arch` with
a name, so an architecture registered with one dict entry is validated, counted and decoded from
what it declares (layers/contract.py does the same for kernels and position methods).
"""

import dataclasses
from typing import Callable


def same_config(cfg):
  """A stack built from `config.model` as it is."""
  return cfg


@dataclasses.dataclass(frozen=True)
class StackSpec:
  """One Transformer stack (`models.stack.Stack`) of an architecture.

  Attributes:
    role: the model's attribute that holds the stack ('encoder', 'decoder'), and how messages and
      `models.layer_attentions` name it.
    causal: no token of its self-attention reads a later one (beyond a prefix the stack reads
      whole): a variant must have a causal form, and routing that reads later tokens (MoE expert
      choice) is refused. False: every token sees the whole row (an encoder).
    cross_attention: its blocks attend to another stack's output (a dense layer each).
    positions: it builds `model.position` (its parameters are counted once per such stack).
    config: `config.model` -> the config the stack is built from (an encoder-decoder's decoder
      takes `model.decoder_attention`).
  """

  role: str
  causal: bool
  cross_attention: bool = False
  positions: bool = True
  config: Callable = same_config


@dataclasses.dataclass(frozen=True)
class ArchSpec:
  """What one architecture (`config.model.arch`) is and takes.

  Attributes:
    stacks: its Transformer stacks, in build order (() for a model without any: the RNN, which
      then takes no `model.layer_pattern`, `model.scan_layers` nor accounting's closed forms).
    batch_format: the row layout it reads, a key of `data.pipeline.BATCH_FORMATS`.
    decoder: the role of the stack that decodes token by token with the KV cache (None: no stack
      does; the KV-cache checks and tables then skip it).
    translation: how it translates (`training.translation.TRANSLATORS`): 'prompt' continues
      `<bos> source <sep>` in one row, 'source' decodes from `<bos>` over the encoded source,
      'fill' fills a masked target of the reference length in one pass.
    packings: the `data.packing` values it takes; `packing_note` says why not the others.
    packing_note: the reason a message gives for a refused packing, e.g. ' (a recurrence reads
      one pair per row)' ('' for none).
    documents: it reads rows of one text without a source side (data.task text_lm, python_code).
    causal_lm: it predicts each token of a row from the tokens before it, as the generated tasks
      (passkey, synthetic) and stream extrapolation (eval.py --lengths) need.
    tiled_loss: it has `loss_features` (hidden states before a tied output table), which
      `train.loss_chunk` tiles.
    options: the `config.model` fields it reads beyond its stacks' (refusals name their readers).
  """

  stacks: tuple = ()
  batch_format: str = 'next_token'
  decoder: str | None = None
  translation: str = 'prompt'
  packings: tuple = ('none', 'segments', 'stream')
  packing_note: str = ''
  documents: bool = False
  causal_lm: bool = False
  tiled_loss: bool = True
  options: tuple = ()

  @property
  def causal(self):
    """Whether any of its stacks is causal."""
    return any(s.causal for s in self.stacks)

  @property
  def cross_attention(self):
    """Whether a stack attends to another's output."""
    return any(s.cross_attention for s in self.stacks)

  def stack(self, role):
    """The `StackSpec` of `role` (KeyError if it has none)."""
    for s in self.stacks:
      if s.role == role:
        return s
    raise KeyError(f'no stack {role!r}; stacks: {[s.role for s in self.stacks]}')
