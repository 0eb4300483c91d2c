"""Translation metrics of a trained model: greedy/beam/sampled decoding (KV cache), exact match,
token accuracy and BLEU per split and per source-length bucket."""

import sys

import jax
import jax.numpy as jnp
from flax import nnx
import numpy as np

import models
from models import decoding
from training import distributed


LENGTH_BUCKETS = (0, 7, 13, 19, 26, 33)  # source-length bucket starts (words)


def _fill_masks(model, examples, tokenizer, batch_size=64):
  """Encoder-only, non-autoregressive: every target token (the reference's length, an oracle) is
  `<mask>`; all are predicted in one pass. Returns the predicted target token lists."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def predict(params, inputs, segment_ids):
    logits = nnx.merge(graphdef, params)({'inputs': inputs, 'segment_ids': segment_ids})
    return jnp.argmax(logits, axis=-1)  # [B, L]

  rows = [[tokenizer.bos_id] + e['source_ids'] + [tokenizer.sep_id]
          + [tokenizer.mask_id] * len(e['target_ids']) + [tokenizer.eos_id] for e in examples]
  length = max(len(r) for r in rows)
  model.encoder.position.check_length(length)
  hyps = []
  for start in range(0, len(rows), batch_size):
    chunk = rows[start:start + batch_size]
    chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))
    inputs = np.zeros((batch_size, length), np.int32)
    for i, r in enumerate(chunk):
      inputs[i, :len(r)] = r
    pred = np.asarray(predict(params, inputs, (inputs > 0).astype(np.int32)))
    for i, e in enumerate(examples[start:start + batch_size]):
      first = len(e['source_ids']) + 2
      hyps.append(pred[i, first:first + len(e['target_ids'])].tolist())
  return hyps


def generate_translations(config, model, examples, tokenizer, *, method='greedy', max_new=None,
                          **decode_kwargs):
  """Translations of `examples` by the run's architecture, as it declares
  (`models.contract.ArchSpec.translation`, a key of `TRANSLATORS`).

  'prompt' (decoder_only) continues `<bos> source <sep>`; 'source' (encoder_decoder, rnn_seq2seq)
  decodes from `<bos>` over the encoded `source <eos>` (all with the KV cache / recurrent state,
  `models.decoding`); 'fill' (encoder_only) fills a fully masked target of the reference length in
  one pass (an oracle length: a non-autoregressive score, not comparable one to one with the
  others). `max_new`: the decoding budget, by default one more token than the longest reference.
  """
  spec = models.spec(config.model.arch)
  if spec.translation == 'fill':
    return _fill_masks(model, examples, tokenizer)
  max_new = max_new or max(len(e['target_ids']) for e in examples) + 1
  return TRANSLATORS[spec.translation](config, model, examples, tokenizer, method=method,
                                       max_new=max_new, decode_kwargs=decode_kwargs)


def _continue_prompts(config, model, examples, tokenizer, *, method, max_new, decode_kwargs):
  """'prompt': each row continues `<bos> source <sep>` with the decoding stack's KV cache."""
  prompts = [[tokenizer.bos_id] + e['source_ids'] + [tokenizer.sep_id] for e in examples]
  # Longer test splits need a longer buffer than training (that is the extrapolation).
  length = max(config.data.max_length, max(len(p) for p in prompts) + max_new)
  getattr(model, models.spec(config.model.arch).decoder).position.check_length(length)
  if method == 'greedy' and not decode_kwargs:
    return decoding.greedy_translate(model, prompts, length=length, max_new=max_new,
                                     eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  return decoding.generate(model, prompts, length=length, max_new=max_new,
                           eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, method=method,
                           **decode_kwargs)


def _decode_from_source(config, model, examples, tokenizer, *, method, max_new, decode_kwargs):
  """'source': each row decodes from `<bos>` over its encoded `source <eos>`."""
  sources = [e['source_ids'] + [tokenizer.eos_id] for e in examples]
  spec = models.spec(config.model.arch)
  for s in spec.stacks:  # the Transformer stacks' position tables (none in an RNN)
    getattr(model, s.role).position.check_length(
        max_new + 1 if s.role == spec.decoder else max(len(x) for x in sources))
  return decoding.generate(model, [[tokenizer.bos_id]] * len(examples), sources=sources,
                           max_new=max_new, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                           method=method, **decode_kwargs)


# `ArchSpec.translation` -> how the architecture's model translates (the 'fill' of a one-pass
# model is `_fill_masks`, which takes no decoding options).
TRANSLATORS = {'prompt': _continue_prompts, 'source': _decode_from_source}


def bleu(hyp_texts, ref_texts):
  """Corpus BLEU (sacrebleu, 0-100, its own 13a tokenization) of detokenized hypotheses against
  one reference text each."""
  import sacrebleu
  return float(sacrebleu.corpus_bleu(list(hyp_texts), [list(ref_texts)]).score)


SAMPLE_BATCH = 64  # rows per sampling batch (models.decoding.generate's default)


def translate(config, model, examples, tokenizer, *, method='greedy', **decode_kwargs):
  """Translates `examples`; returns exact match, token accuracy, BLEU and a few samples."""
  refs = [e['target_ids'] for e in examples]
  # Every process decodes its share with the budget of the whole split. Sampling cuts the shares
  # at whole decoding batches, each keyed by its place in the split: the samples of one process.
  if method == 'sample':
    rows = min(SAMPLE_BATCH, len(examples))
    start, stop = distributed.process_share(len(examples), align=rows)
    decode_kwargs = dict(decode_kwargs, batch_size=rows, row_offset=start)
  else:
    start, stop = distributed.process_share(len(examples))
  hyps = (generate_translations(config, model, examples[start:stop], tokenizer, method=method,
                                max_new=max(len(r) for r in refs) + 1, **decode_kwargs)
          if stop > start else [])
  if jax.process_count() > 1:
    print(f'eval: process {jax.process_index()} of {jax.process_count()} decodes sentences '
          f'{start}-{stop} of {len(examples)}', file=sys.stderr)
  hyps = distributed.gather_token_lists(hyps)
  # Exact match on detokenized text: SentencePiece can spell one text with several piece
  # sequences (for the toy tokenizer text and ids match one to one).
  hyp_texts = [tokenizer.decode(h) for h in hyps]
  matches = [t == tokenizer.decode(r) for t, r in zip(hyp_texts, refs)]
  exact = sum(matches)
  # Token accuracy: reference positions (and the final eos) predicted correctly at the same index.
  correct = total = 0
  for h, r in zip(hyps, refs):
    r_eos, h_eos = r + [tokenizer.eos_id], h + [tokenizer.eos_id]
    correct += sum(a == b for a, b in zip(h_eos, r_eos))
    total += len(r_eos)
  samples = [{'source': e['source'], 'reference': e['target'], 'output': text}
             for e, text in zip(examples[:5], hyp_texts[:5])]
  buckets = {}
  for e, match in zip(examples, matches):
    n = len(e['source_ids'])
    lo = next(b for b in reversed(LENGTH_BUCKETS) if n >= b)
    hit, cnt = buckets.get(lo, (0, 0))
    buckets[lo] = (hit + match, cnt + 1)
  by_length = [{'source_words': f'{lo}-{hi - 1}', 'exact_match': hit / cnt, 'n': cnt}
               for lo, hi in zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:] + (10 ** 6,))
               if lo in buckets for hit, cnt in [buckets[lo]]]
  return {'exact_match': exact / len(refs), 'token_accuracy': correct / total,
          # Against the references as written, not re-spelt by the tokenizer.
          'bleu': bleu(hyp_texts, [e['target'] for e in examples]), 'n': len(refs),
          'by_length': by_length,
          'samples': samples, 'decoding': method}


