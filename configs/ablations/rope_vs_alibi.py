"""RoPE vs ALiBi (and every other position method) length extrapolation on the toy stream.

Every cell trains configs/extrapolation.py at L=64 with one position method; evaluation at
1, 2, 4, 8 x L (eval.py --lengths=1,2,4,8), RoPE cells also with scaling applied at evaluation.
"""

from configs import extrapolation


def get_config(arg=None):
  """The base config every cell starts from."""
  return extrapolation.get_config(arg)


def get_sweep():
  """Cells: config overrides (dotted field -> value), seeds, and the eval.py flags per cell."""
  positions = ['sinusoidal', 'learned', 'rope', 'alibi', 't5_bias', 'nope']
  cells = [{'model.position': p} for p in positions]
  return {
      'cells': cells,
      'seeds': [0],
      'eval_flags': ['--lengths=1,2,4,8', '--modes=non_overlapping,sliding'],
      # RoPE again at evaluation with each scaling (the same checkpoint, eval only).
      'eval_variants': {'model.position=rope': ['--rope_scaling=pi:4', '--rope_scaling=ntk:4',
                                                '--rope_scaling=yarn:4']},
  }
