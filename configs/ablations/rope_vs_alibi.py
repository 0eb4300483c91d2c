"""Every position method's length extrapolation on the toy stream, three seeds per method.

Every cell trains configs/extrapolation.py at L=64 (6 layers, d_model 64, 1,000 steps) with one
position method: alibi, rope, sinusoidal, nope, t5_bias, fire, xpos, kerple, and RoPE with
randomized positions (Ruoss et al. 2023: ids drawn from [0, 8L) while training); 9 x 3 = 27
cells. Evaluation at 1, 2, 4, 8 x L (eval.py --lengths=1,2,4,8), the plain RoPE cells also with
each scaling applied at evaluation. `learned` is left out: its table has L rows, so it cannot be
evaluated beyond L.

Run:     python -m tools.sweep --sweep=configs/ablations/rope_vs_alibi.py --sweep_dir=DIR \
             --sweep_eval --parallel=2
Compare: python -m tools.compare DIR --out=DIR/compare.png
"""

from configs import extrapolation

POSITIONS = ('alibi', 'rope', 'sinusoidal', 'nope', 't5_bias', 'fire', 'xpos', 'kerple')
RANDOM_POSITIONS_MAX = 512  # 8L: every evaluated position is drawn at some training step


def get_config(arg=None):
  """The base config every cell starts from."""
  config = extrapolation.get_config(arg)
  # FIRE's threshold starts at the training length: within it the bias is relative, beyond it the
  # progressive interpolation keeps the MLP's input in [0, 1] (the listing's 512 is for longer
  # training contexts; L is learned either way).
  config.model.fire_threshold = 64.0
  # xPos with the paper's blockwise causal attention at inference, blocks of the training length
  # (plain causal attention while training at L).
  config.model.xpos_block = 64
  return config


def get_sweep():
  """Cells: config overrides (dotted field -> value), seeds, and the eval.py flags per cell."""
  cells = [{'model.position': p} for p in POSITIONS]
  cells.append({'model.position': 'rope', 'model.random_positions_max': RANDOM_POSITIONS_MAX})
  return {
      'cells': cells,
      'seeds': [0, 1, 2],
      'eval_flags': ['--lengths=1,2,4,8', '--modes=non_overlapping,sliding'],
      # RoPE again at evaluation with each scaling (the same checkpoint, eval only).
      'eval_variants': {'model.position=rope': ['--rope_scaling=pi:4', '--rope_scaling=ntk:4',
                                                '--rope_scaling=yarn:4']},
  }
