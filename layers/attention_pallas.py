"""FlashAttention-2 as Pallas kernels: the kernel of the platform the program is lowered for.

The kernel is chosen by the platform the program is lowered for (`lax.platform_dependent`), not by
the host that traces it: a program compiled on a CPU host for a pod holds the pod's kernel.
cuda/rocm: the Triton kernels of `layers.attention_pallas_gpu`; tpu: the Mosaic kernels of
`layers.attention_pallas_tpu` (dense bias/mask arrays go to the blockwise kernel there); any other
platform: the Triton kernels interpreted.
"""

from jax import lax

from layers import attention_blockwise
from layers import attention_pallas_gpu
from layers import attention_pallas_tpu

# The Triton kernels themselves (backend 'triton' or 'interpret'), for callers that want them.
gpu_attention = attention_pallas_gpu.attention


def attention(query, key, value, bias=None, mask=None, *, scale, is_causal=False, window=None,
              alibi_slopes=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
              sinks=None, block_q=attention_pallas_gpu.DEFAULT_BLOCK_Q,
              block_k=attention_pallas_gpu.DEFAULT_BLOCK_K):
  """Pallas FlashAttention-2 for the platform the program is lowered for; the arguments are those
  of `attention_blockwise.attention` (block_q/block_k: the Triton/interpreted kernel's tiles; the
  TPU kernel keeps its own multiples of 128).

  Every branch is traced; lowering keeps only the lowering platform's (the others never reach a
  compiler), so a CPU host can lower the pod's kernel, and the unit tests check that it does.

  Returns:
    `[B, T, N, H]` in the query's dtype; rows with no visible key are zeros.
  """
  kw = dict(scale=scale, is_causal=is_causal, window=window, softcap=softcap)

  def gpu(backend):
    return lambda x, y, z, o: attention_pallas_gpu.attention(
        x, y, z, o['bias'], o['mask'], alibi_slopes=o['slopes'], q_segment_ids=o['q_seg'],
        kv_segment_ids=o['kv_seg'], sinks=o['sinks'], block_q=block_q, block_k=block_k,
        backend=backend, **kw)

  def tpu(x, y, z, o):
    if o['bias'] is not None or o['mask'] is not None:
      # The Mosaic kernel takes no dense [T, S] arrays; the blockwise kernel does, in O(T) memory.
      return attention_blockwise.attention(
          x, y, z, o['bias'], o['mask'], alibi_slopes=o['slopes'], q_segment_ids=o['q_seg'],
          kv_segment_ids=o['kv_seg'], sinks=o['sinks'], **kw)
    return attention_pallas_tpu.attention(x, y, z, alibi_slopes=o['slopes'],
                                          q_segment_ids=o['q_seg'], kv_segment_ids=o['kv_seg'],
                                          sinks=o['sinks'], **kw)

  extra = {'bias': bias, 'mask': mask, 'slopes': alibi_slopes, 'q_seg': q_segment_ids,
           'kv_seg': kv_segment_ids, 'sinks': sinks}
  return lax.platform_dependent(query, key, value, extra, cuda=gpu('triton'), rocm=gpu('triton'),
                                tpu=tpu, default=gpu('interpret'))
