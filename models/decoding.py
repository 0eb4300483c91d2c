"""Autoregressive decoding with a KV cache: greedy, beam search (length penalty), sampling.

Every model with `init_cache(batch, max_length)` and `decode_step(cache, tokens, index)` decodes
here (decoder-only, encoder-decoder, RNN). The cache is an explicit pytree passed in and returned;
prompts are fed token by token through the same step (teacher-forced), so rows with different
prompt lengths need no special prefill: a row generates once its prompt is consumed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layers import paged_attention

METHODS = ('greedy', 'beam', 'sample')
_NEG = -1e9  # a finite "impossible" log-probability: no inf - inf in the beam arithmetic


@functools.partial(jax.jit, static_argnums=(0, 3))
def init_cache(graphdef, params, batch, max_length):
  """`model.init_cache(batch, max_length)` of the merged model, jitted (encoders run here)."""
  return nnx.merge(graphdef, params).init_cache(batch, max_length)


@functools.partial(jax.jit, static_argnums=(0,))
def decode_step(graphdef, params, cache, tokens, index):
  """One cached step: (`[B, V]` logits of the next token, cache) for `tokens` `[B]` at `index`.

  Args:
    graphdef, params: `nnx.split(model)`.
    cache: from `init_cache`.
    tokens: `[B]` int.
    index: `[B]` or scalar absolute positions of `tokens`.
  """
  return nnx.merge(graphdef, params).decode_step(cache, tokens, index)


def cache_size(cache):
  """Elements in the self-attention cache (2 x layers x K x H x length per row)."""
  return sum(x.size for x in jax.tree.leaves(cache['self']))


def sample_logits(rng, logits, *, temperature=1.0, top_k=0, top_p=1.0):
  """Draws one token per row of `[B, V]` logits; temperature 0 is greedy.

  top_k keeps the k most likely tokens; top_p (nucleus) keeps the smallest set of most likely
  tokens whose probability reaches p (the most likely token is always kept).
  """
  if temperature == 0:
    return jnp.argmax(logits, axis=-1)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]  # [B, 1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
    cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(rng, logits, axis=-1)


def length_penalty_fn(length, alpha):
  """GNMT's lp(|Y|) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016); beams are ranked by log P / lp."""
  return ((5.0 + length.astype(jnp.float32)) / 6.0) ** alpha


def _step_loop(model, cache, buf, plen, rng, *, max_new, eos_id, pad_id, temperature, top_k,
               top_p):
  """Greedy (temperature 0) or sampled continuation of `buf` `[B, L]`; returns the filled buffer."""
  length = buf.shape[1]

  def cond(carry):
    t, _, done, _ = carry
    return (t < length - 1) & ~jnp.all(done)

  def body(carry):
    t, buf, done, cache = carry
    logits, cache = model.decode_step(cache, buf[:, t], t)  # [B, V]
    nxt = sample_logits(jax.random.fold_in(rng, t), logits, temperature=temperature,
                        top_k=top_k, top_p=top_p).astype(buf.dtype)  # [B]
    gen = t + 1 >= plen  # position t + 1 is generated, not prompt
    write = gen & ~done
    buf = buf.at[:, t + 1].set(jnp.where(write, nxt, jnp.where(gen, pad_id, buf[:, t + 1])))
    done = done | (write & ((nxt == eos_id) | (t + 2 - plen >= max_new)))
    return t + 1, buf, done, cache

  done = plen >= length
  _, buf, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), buf, done, cache))
  return buf


def _beam_loop(model, cache, buf, plen, *, num_beams, max_new, eos_id, pad_id, length_penalty):
  """Beam search; `cache` and `buf` `[B * W, L]` hold W copies of each row. Returns `[B, L]`."""
  bw, length = buf.shape
  w = num_beams
  b = bw // w
  buf = buf.reshape(b, w, length)
  scores = jnp.tile(jnp.asarray([0.0] + [_NEG] * (w - 1), jnp.float32), (b, 1))  # [B, W]
  lengths = jnp.zeros((b, w), jnp.int32)
  finished = jnp.zeros((b, w), bool)

  def cond(carry):
    t, _, _, _, finished, _ = carry
    return (t < length - 1) & ~jnp.all(finished)

  def body(carry):
    t, buf, scores, lengths, finished, cache = carry
    logits, cache = model.decode_step(cache, buf.reshape(bw, length)[:, t], t)  # [BW, V]
    v = logits.shape[-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(b, w, v)  # [B, W, V]
    # A finished beam continues only with padding, at no cost, so it keeps its score.
    pad_only = jnp.where(jnp.arange(v) == pad_id, 0.0, _NEG)  # [V]
    logp = jnp.where(finished[..., None], pad_only, logp)
    cand = scores[..., None] + logp  # [B, W, V]
    new_len = lengths + (~finished).astype(jnp.int32)  # [B, W]
    rank = cand / length_penalty_fn(new_len, length_penalty)[..., None]
    _, idx = jax.lax.top_k(rank.reshape(b, w * v), w)  # [B, W]
    gen = (t + 1 >= plen)[:, None]  # [B, 1]: rows still reading their prompt keep their beams
    beam = jnp.where(gen, idx // v, jnp.arange(w)[None])  # [B, W]
    tok = jnp.where(gen, idx % v, buf[:, :, t + 1]).astype(buf.dtype)
    scores = jnp.where(gen, jnp.take_along_axis(cand.reshape(b, w * v), idx, 1), scores)
    lengths = jnp.where(gen, jnp.take_along_axis(new_len, beam, 1), lengths)
    was_finished = jnp.take_along_axis(finished, beam, 1)
    finished = jnp.where(gen, was_finished | (tok == eos_id) | (lengths >= max_new), finished)
    buf = jnp.take_along_axis(buf, beam[..., None], 1).at[:, :, t + 1].set(tok)
    rows = (jnp.arange(b)[:, None] * w + beam).reshape(bw)  # [BW] source beam of each new beam
    cache = {**cache, 'self': jax.tree.map(lambda a: a[rows], cache['self'])}
    return t + 1, buf, scores, lengths, finished, cache

  _, buf, scores, lengths, _, _ = jax.lax.while_loop(
      cond, body, (jnp.int32(0), buf, scores, lengths, finished, cache))
  best = jnp.argmax(scores / length_penalty_fn(lengths, length_penalty), axis=1)  # [B]
  return buf[jnp.arange(b), best]


@functools.partial(jax.jit, static_argnames=(
    'graphdef', 'method', 'max_new', 'eos_id', 'pad_id', 'num_beams', 'length_penalty',
    'temperature', 'top_k', 'top_p'))
def _generate(graphdef, params, batch, buf, plen, rng, *, method, max_new, eos_id, pad_id,
              num_beams, length_penalty, temperature, top_k, top_p):
  model = nnx.merge(graphdef, params)
  length = buf.shape[1]
  if method == 'beam':
    expand = lambda a: jnp.repeat(a, num_beams, axis=0)  # noqa: E731
    cache = model.init_cache(jax.tree.map(expand, batch), length)
    return _beam_loop(model, cache, expand(buf), plen, num_beams=num_beams, max_new=max_new,
                      eos_id=eos_id, pad_id=pad_id, length_penalty=length_penalty)
  cache = model.init_cache(batch, length)
  return _step_loop(model, cache, buf, plen, rng, max_new=max_new, eos_id=eos_id, pad_id=pad_id,
                    temperature=0.0 if method == 'greedy' else temperature, top_k=top_k,
                    top_p=top_p)


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4, 5))
def _init_paged_cache(graphdef, params, batch_size, length, page_size, num_pages):
  model = nnx.merge(graphdef, params)
  return model.init_cache({'inputs': jnp.zeros((batch_size, 1), jnp.int32)}, length,
                          page_size=page_size, num_pages=num_pages)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,),
                   static_argnames=('temperature', 'top_k', 'top_p'))
def _paged_step(graphdef, params, cache, tokens, t, rng, *, temperature, top_k, top_p):
  """One step of `_paged_loop`: (the `[B]` next tokens, the cache); the pools are donated."""
  logits, cache = nnx.merge(graphdef, params).decode_step(cache, tokens, t)  # [B, V]
  return sample_logits(jax.random.fold_in(rng, t), logits, temperature=temperature, top_k=top_k,
                       top_p=top_p), cache


def _paged_loop(graphdef, params, buf, plen, rng, *, max_new, eos_id, pad_id, temperature, top_k,
                top_p, page_size, num_pages):
  """`_step_loop` with a paged cache: the same tokens, but driven from the host, where the
  `PageAllocator` gives each row a page as it crosses into one and takes its pages back when the
  row finishes, so the rows share a pool smaller than B x S_max. Returns the filled buffer."""
  buf = np.array(buf)
  b, length = buf.shape
  alloc = paged_attention.PageAllocator(num_pages, page_size, b,
                                        paged_attention.pages_for(length, page_size))
  cache = _init_paged_cache(graphdef, params, b, length, page_size, num_pages)
  done = plen >= length
  for t in range(length - 1):
    if done.all():
      break
    for row in np.flatnonzero(~done):
      alloc.reserve(row, t + 1)  # its token at position t goes to slot t
    # Finished rows point at the null page: their (ignored) step writes nothing that is shared.
    cache['block_table'] = jnp.asarray(alloc.block_table)
    nxt, cache = _paged_step(graphdef, params, cache, jnp.asarray(buf[:, t]), jnp.int32(t), rng,
                             temperature=temperature, top_k=top_k, top_p=top_p)
    nxt = np.asarray(nxt).astype(buf.dtype)  # [B]
    gen = t + 1 >= plen  # position t + 1 is generated, not prompt
    write = gen & ~done
    buf[:, t + 1] = np.where(write, nxt, np.where(gen, pad_id, buf[:, t + 1]))
    finished = write & ((nxt == eos_id) | (t + 2 - plen >= max_new))
    done = done | finished
    for row in np.flatnonzero(finished):
      alloc.free(row)
  return buf


def _pad_rows(rows, length, pad_id):
  out = np.full((len(rows), length), pad_id, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r[:length]
  return out


def generate(model, prompts, *, max_new, eos_id, pad_id=0, sources=None, method='greedy',
             num_beams=4, length_penalty=0.6, temperature=1.0, top_k=0, top_p=1.0, seed=0,
             batch_size=64, length=None, paged=False, page_size=16, num_pages=None, row_offset=0):
  """Continuations of `prompts` with the KV cache.

  Args:
    model: an NNX model with `init_cache` / `decode_step` (decoder-only, encoder-decoder, RNN).
    prompts: token lists fed to the decoder first (decoder-only: `<bos> source <sep>`;
      encoder-decoder: `[<bos>]`).
    max_new: most tokens generated per prompt.
    eos_id, pad_id: special ids.
    sources: encoder inputs (`source <eos>` token lists), or None for decoder-only models.
    method: 'greedy' | 'beam' | 'sample'.
    num_beams, length_penalty: beam search width and GNMT alpha (0 = raw log-probability).
    temperature, top_k, top_p: sampling (top_k 0 and top_p 1 = off).
    seed: sampling randomness.
    batch_size: rows decoded together.
    row_offset: the index of `prompts[0]` in a larger list decoded in parts (eval.py's processes):
      with parts cut at multiples of `batch_size`, each batch samples as in the whole list.
    length: the decoder buffer (prompt + continuation); default longest prompt + max_new.
    paged: decode with a paged KV cache (layers.paged_attention; decoder-only, greedy/sample):
      pages of `page_size` tokens from a pool of `num_pages` (default: enough for every row at
      `length`) are allocated on the host as rows grow and freed as they finish.

  Returns:
    Generated token lists (prompt excluded, cut before the first eos).
  """
  if method not in METHODS:
    raise ValueError(f'decoding method {method!r} unknown; valid: {list(METHODS)}')
  if paged and (method == 'beam' or sources is not None):
    # Beams reorder cache rows every step (pages would need copy-on-write sharing); the
    # encoder-decoder's cache is built by its own init_cache, which has no paged form.
    raise ValueError('paged=True supports decoder-only greedy/sample decoding only')
  graphdef, params = nnx.split(model)
  if length is None:
    length = max(len(p) for p in prompts) + max_new
  src_len = max(len(s) for s in sources) if sources is not None else 0
  batch_size = min(batch_size, len(prompts))
  rng = jax.random.key(seed)
  out = []
  for start in range(0, len(prompts), batch_size):
    chunk = list(prompts[start:start + batch_size])
    n = len(chunk)
    chunk += [chunk[-1]] * (batch_size - n)  # fixed shapes: compile once
    plen = np.asarray([min(len(p), length) for p in chunk], np.int32)
    buf = _pad_rows(chunk, length, pad_id)
    if sources is not None:
      src = list(sources[start:start + batch_size])
      src += [src[-1]] * (batch_size - n)
      src_inputs = _pad_rows(src, src_len, pad_id)
      real = np.arange(src_len)[None] < np.asarray([len(s) for s in src])[:, None]
      batch = {'src_inputs': src_inputs, 'src_segment_ids': real.astype(np.int32),
               'src_positions': np.where(real, np.arange(src_len)[None], 0).astype(np.int32)}
    else:
      batch = {'inputs': buf}
    if paged:
      filled = _paged_loop(
          graphdef, params, buf, plen, jax.random.fold_in(rng, row_offset + start), max_new=max_new,
          eos_id=eos_id, pad_id=pad_id, temperature=0.0 if method == 'greedy' else
          float(temperature), top_k=int(top_k), top_p=float(top_p), page_size=int(page_size),
          num_pages=num_pages or paged_attention.default_num_pages(batch_size, length, page_size))
    else:
      filled = np.asarray(_generate(
          graphdef, params, batch, jnp.asarray(buf), jnp.asarray(plen),
          jax.random.fold_in(rng, row_offset + start), method=method, max_new=max_new,
          eos_id=eos_id,
          pad_id=pad_id, num_beams=num_beams, length_penalty=float(length_penalty),
          temperature=float(temperature), top_k=int(top_k), top_p=float(top_p)))
    for i in range(n):
      gen = filled[i, plen[i]:plen[i] + max_new].tolist()
      out.append(gen[:gen.index(eos_id)] if eos_id in gen else gen)
  return out


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _greedy(graphdef, params, tokens, cursor, max_new, eos_id):
  """Fills `tokens` `[B, L]` from each row's `cursor` on, one greedy token per iteration.

  Every iteration reruns the full causal forward over the fixed `[B, L]` buffer (causality makes the
  not-yet-written positions irrelevant), so the whole loop is one compiled program. No cache: the
  reference the cached path is measured against (benchmarks/decode.py).
  """
  model = nnx.merge(graphdef, params)
  b, length = tokens.shape
  rows = jnp.arange(b)

  def body(_, carry):
    tokens, cursor, done = carry
    logits = model({'inputs': tokens})  # [B, L, V]
    nxt = jnp.argmax(logits[rows, cursor - 1], axis=-1).astype(tokens.dtype)  # [B]
    write = ~done & (cursor < length)
    tokens = tokens.at[rows, jnp.minimum(cursor, length - 1)].set(
        jnp.where(write, nxt, tokens[rows, jnp.minimum(cursor, length - 1)]))
    done = done | (write & (nxt == eos_id)) | (cursor + 1 >= length)
    return tokens, cursor + write.astype(cursor.dtype), done

  done = cursor >= length
  tokens, _, _ = jax.lax.fori_loop(0, max_new, body, (tokens, cursor, done))
  return tokens


def greedy_translate(model, prompts, *, length, max_new, eos_id, pad_id=0, batch_size=256,
                     use_cache=True):
  """Greedy continuations of decoder-only prompts.

  Args:
    model: a decoder-only model (called as `model({'inputs': tokens})` -> `[B, L, V]` logits).
    prompts: list of token lists (`<bos> source <sep>`).
    length: buffer length L (prompt + continuation), at most the model's trained length for learned
      positions.
    max_new: most tokens generated per prompt.
    eos_id, pad_id: special ids.
    batch_size: prompts decoded together.
    use_cache: the KV-cache path (`generate`); False reruns the full forward every token.

  Returns:
    List of generated token lists (without the prompt, cut after the first eos, eos excluded).
  """
  if use_cache:
    prompts = [p[:length] for p in prompts]
    return generate(model, prompts, max_new=max_new, eos_id=eos_id, pad_id=pad_id,
                    batch_size=batch_size, length=length)
  graphdef, params = nnx.split(model)
  out = []
  for start in range(0, len(prompts), batch_size):
    chunk = prompts[start:start + batch_size]
    n = len(chunk)
    chunk = chunk + [chunk[-1]] * (batch_size - n)  # fixed shape: compile once
    tokens = np.full((batch_size, length), pad_id, np.int32)
    cursor = np.zeros((batch_size,), np.int32)
    for i, p in enumerate(chunk):
      p = p[:length]
      tokens[i, :len(p)] = p
      cursor[i] = len(p)
    filled = np.asarray(_greedy(graphdef, params, jnp.asarray(tokens), jnp.asarray(cursor),
                                max_new, eos_id))
    for i in range(n):
      gen = filled[i, cursor[i]:cursor[i] + max_new].tolist()
      out.append(gen[:gen.index(eos_id)] if eos_id in gen else gen)
  return out
