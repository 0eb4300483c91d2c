"""Which Hugging Face tensor is which attnlab parameter, and how each is reshaped between them.

A `Tensor` names one checkpoint tensor, its shape, the attnlab parameters it holds (paths in the
model's `nnx.Param` state) and the two conversions. The list is computed from the resolved
`config.model` alone, so it can be checked against an abstract model (no arrays) before anything
is read.

Layouts. transformers' `nn.Linear` stores `[out, in]`, attnlab's kernels `[in, out]` with the
heads split out (q `[D, N, H]`, k/v `[D, K, H]`, o `[N, H, D]`); GPT-2's `Conv1D` stores
`[in, out]` and fuses q, k and v along `out`. RoPE: transformers' Llama-family checkpoints rotate
pairs (x_i, x_{i + H/2}) ("rotate half"), as attnlab's RoPE does, so q and k are copied without a
permutation; a checkpoint in Meta's original interleaved layout would need each head's output
columns permuted (`interleaved_to_half`), which tests/unit/test_hf_checkpoints.py uses to show that
a wrong layout changes the logits.
"""

from typing import Callable, NamedTuple

import numpy as np


class Tensor(NamedTuple):
  """One checkpoint tensor: `name` `shape` <-> the parameters at `paths`.

  `to_ours(array)` returns one array per path; `to_hf(arrays)` joins them back (the exact inverse:
  only transposes, reshapes, splits and joins).
  """

  name: str
  shape: tuple
  paths: tuple
  to_ours: Callable
  to_hf: Callable


def interleaved_to_half(w, num_heads, head_dim):
  """Permutes a q/k `[N·H, D]` weight (`[out, in]`) from interleaved pairs (x_2i, x_2i+1) to rotate
  half (x_i, x_{i+H/2}): output column order [0, 2, 4, ..., 1, 3, 5, ...] within each head."""
  order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
  return w.reshape(num_heads, head_dim, -1)[:, order].reshape(w.shape)


def _same(name, shape, path):
  return Tensor(name, tuple(shape), (path,), lambda a: [a], lambda xs: xs[0])


def _linear(name, d_in, d_out, path):
  """`nn.Linear` `[out, in]` <-> kernel `[in, out]`."""
  return Tensor(name, (d_out, d_in), (path,), lambda a: [a.T], lambda xs: xs[0].T)


def _heads_in(name, d_model, heads, head_dim, path):
  """q/k/v `nn.Linear` `[heads·H, D]` <-> kernel `[D, heads, H]`."""
  return Tensor(name, (heads * head_dim, d_model), (path,),
                lambda a: [a.T.reshape(d_model, heads, head_dim)],
                lambda xs: xs[0].reshape(d_model, heads * head_dim).T)


def _heads_bias(name, heads, head_dim, path):
  return Tensor(name, (heads * head_dim,), (path,), lambda a: [a.reshape(heads, head_dim)],
                lambda xs: xs[0].reshape(heads * head_dim))


def _heads_out(name, d_model, heads, head_dim, path):
  """o `nn.Linear` `[D, N·H]` <-> kernel `[N, H, D]`."""
  return Tensor(name, (d_model, heads * head_dim), (path,),
                lambda a: [a.T.reshape(heads, head_dim, d_model)],
                lambda xs: xs[0].reshape(heads * head_dim, d_model).T)


def llama_tensors(m):
  """Llama, Mistral, Qwen2, Qwen3 (`model.layers.{i}...`) for a resolved `config.model` `m`."""
  d, n, k, h, f = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.d_ff
  v = m.vocab_size
  out = [_same('model.embed_tokens.weight', (v, d), ('decoder', 'embed', 'embedding')),
         _same('model.norm.weight', (d,), ('decoder', 'final_norm', 'scale'))]
  if not m.tie_output:
    out.append(_linear('lm_head.weight', d, v, ('decoder', 'output', 'kernel')))
  qkv_bias = m.attention_bias
  for i in range(m.num_layers):
    hf, ours = f'model.layers.{i}.', ('decoder', 'blocks', i)
    att = ours + ('self_attention',)
    out += [_same(hf + 'input_layernorm.weight', (d,), ours + ('self_norm', 'scale')),
            _same(hf + 'post_attention_layernorm.weight', (d,), ours + ('ffn_norm', 'scale')),
            _heads_in(hf + 'self_attn.q_proj.weight', d, n, h, att + ('query', 'kernel')),
            _heads_in(hf + 'self_attn.k_proj.weight', d, k, h, att + ('key', 'kernel')),
            _heads_in(hf + 'self_attn.v_proj.weight', d, k, h, att + ('value', 'kernel')),
            _heads_out(hf + 'self_attn.o_proj.weight', d, n, h, att + ('out', 'kernel')),
            _linear(hf + 'mlp.gate_proj.weight', d, f, ours + ('ffn', 'gate', 'kernel')),
            _linear(hf + 'mlp.up_proj.weight', d, f, ours + ('ffn', 'up', 'kernel')),
            _linear(hf + 'mlp.down_proj.weight', f, d, ours + ('ffn', 'down', 'kernel'))]
    if qkv_bias:
      out += [_heads_bias(hf + f'self_attn.{p}_proj.bias', heads, h, att + (name, 'bias'))
              for p, name, heads in (('q', 'query', n), ('k', 'key', k), ('v', 'value', k))]
      if m.attention_out_bias:
        out.append(_same(hf + 'self_attn.o_proj.bias', (d,), att + ('out', 'bias')))
    if m.ffn_bias:
      out += [_same(hf + f'mlp.{p}_proj.bias', (width,), ours + ('ffn', p, 'bias'))
              for p, width in (('gate', f), ('up', f), ('down', d))]
    if m.qk_norm == 'rmsnorm':
      out += [_same(hf + 'self_attn.q_norm.weight', (h,), att + ('qk_norm', 'query_scale')),
              _same(hf + 'self_attn.k_norm.weight', (h,), att + ('qk_norm', 'key_scale'))]
  return out


def _fused_qkv(name, d_model, heads, head_dim, att):
  """GPT-2's `c_attn` `Conv1D` weight `[D, 3·N·H]` (q | k | v) <-> three `[D, N, H]` kernels."""
  width = heads * head_dim
  return Tensor(name, (d_model, 3 * width), tuple(att + (p, 'kernel') for p in
                                                  ('query', 'key', 'value')),
                lambda a: [a[:, j * width:(j + 1) * width].reshape(d_model, heads, head_dim)
                           for j in range(3)],
                lambda xs: np.concatenate([x.reshape(d_model, width) for x in xs], axis=1))


def _fused_qkv_bias(name, heads, head_dim, att):
  width = heads * head_dim
  return Tensor(name, (3 * width,), tuple(att + (p, 'bias') for p in ('query', 'key', 'value')),
                lambda a: [a[j * width:(j + 1) * width].reshape(heads, head_dim)
                           for j in range(3)],
                lambda xs: np.concatenate([x.reshape(width) for x in xs]))


def gpt2_tensors(m):
  """GPT-2 (`transformer.h.{i}...`, `Conv1D` weights stored `[in, out]`)."""
  d, n, h, f, v = m.d_model, m.num_heads, m.head_dim, m.d_ff, m.vocab_size
  out = [_same('transformer.wte.weight', (v, d), ('decoder', 'embed', 'embedding')),
         _same('transformer.wpe.weight', (m.max_positions, d),
               ('decoder', 'position', 'table', 'embedding')),
         _same('transformer.ln_f.weight', (d,), ('decoder', 'final_norm', 'scale')),
         _same('transformer.ln_f.bias', (d,), ('decoder', 'final_norm', 'bias'))]
  if not m.tie_output:
    out.append(_linear('lm_head.weight', d, v, ('decoder', 'output', 'kernel')))
  for i in range(m.num_layers):
    hf, ours = f'transformer.h.{i}.', ('decoder', 'blocks', i)
    att = ours + ('self_attention',)
    for norm, ln in (('self_norm', 'ln_1'), ('ffn_norm', 'ln_2')):
      out += [_same(hf + f'{ln}.weight', (d,), ours + (norm, 'scale')),
              _same(hf + f'{ln}.bias', (d,), ours + (norm, 'bias'))]
    out += [_fused_qkv(hf + 'attn.c_attn.weight', d, n, h, att),
            _fused_qkv_bias(hf + 'attn.c_attn.bias', n, h, att),
            Tensor(hf + 'attn.c_proj.weight', (n * h, d), (att + ('out', 'kernel'),),
                   lambda a: [a.reshape(n, h, d)], lambda xs: xs[0].reshape(n * h, d)),
            _same(hf + 'attn.c_proj.bias', (d,), att + ('out', 'bias')),
            _same(hf + 'mlp.c_fc.weight', (d, f), ours + ('ffn', 'wi', 'kernel')),
            _same(hf + 'mlp.c_fc.bias', (f,), ours + ('ffn', 'wi', 'bias')),
            _same(hf + 'mlp.c_proj.weight', (f, d), ours + ('ffn', 'wo', 'kernel')),
            _same(hf + 'mlp.c_proj.bias', (d,), ours + ('ffn', 'wo', 'bias'))]
  return out


# Buffers some transformers versions saved beside the weights: not parameters, skipped on import.
IGNORED_SUFFIXES = ('.rotary_emb.inv_freq', '.attn.bias', '.attn.masked_bias')
