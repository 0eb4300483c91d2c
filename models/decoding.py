"""Autoregressive decoding for translation: greedy continuation of `<bos> source <sep>` prompts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _greedy(graphdef, params, tokens, cursor, max_new, eos_id):
  """Fills `tokens` `[B, L]` from each row's `cursor` on, one greedy token per iteration.

  Every iteration reruns the full causal forward over the fixed `[B, L]` buffer (causality makes the
  not-yet-written positions irrelevant), so the whole loop is one compiled program.
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


def greedy_translate(model, prompts, *, length, max_new, eos_id, pad_id=0, batch_size=256):
  """Greedy continuations of decoder-only prompts.

  Args:
    model: a decoder-only model (called as `model({'inputs': tokens})` -> `[B, L, V]` logits).
    prompts: list of token lists (`<bos> source <sep>`).
    length: buffer length L (prompt + continuation), at most the model's trained length for learned
      positions.
    max_new: most tokens generated per prompt.
    eos_id, pad_id: special ids.
    batch_size: prompts decoded together.

  Returns:
    List of generated token lists (without the prompt, cut after the first eos, eos excluded).
  """
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
