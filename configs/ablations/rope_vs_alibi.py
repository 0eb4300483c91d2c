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

`:code` runs the same study on real code (data.task=python_code: the local Python stdlib's
source, where names defined hundreds of tokens back matter), 5 seeds: the same 6-layer model at
L = 64 for 2,000 steps, randomized RoPE with N = 32L = 2,048 (Ruoss et al.'s N lies well above the
longest test length; 8L would be the test length itself), and a RoPE model trained at 4L = 256 as
the reference for "uses more context" (batch 8, so that it trains on the same tokens as the others;
evaluated at 64-512 tokens like them). The randomized
cell is also evaluated at sorted random ids, as it trained (eval_variants).
Compare: python -m tools.compare DIR --baseline=CELL --out=DIR/compare.png (CELL: a cell's label
as the table prints it, e.g. ALiBi's)
`:code,quick`: the smoke form (12 files a split, 2 layers, a few steps).
"""

from configs import default
from configs import extrapolation
from configs import python_code

POSITIONS = ('alibi', 'rope', 'sinusoidal', 'nope', 't5_bias', 'fire', 'xpos', 'kerple')
RANDOM_POSITIONS_MAX = 512  # 8L: every evaluated position is drawn at some training step
CODE_RANDOM_POSITIONS_MAX = 2048  # :code: 32L, well above the longest test window (8L)
CODE_STEPS = 2000
CODE_LENGTH = 64  # :code: L
REFERENCE_LENGTH = 256  # :code: the reference trained at 4L
REFERENCE_BATCH = 8  # :code: the reference's rows of 4L, as many tokens as 32 rows of L
OTHER_ARGS = ('code', 'code,quick')  # the sweep file's other forms (tests/unit/test_sweep.py)

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/positions.md',
    'baseline': {'model.position': 'rope'},
    'metrics': ('final_valid', 'r2', 'r4', 'r8'),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', '29.5 minutes at --parallel=2 on the idle 2-core machine'),
        'code': ('code', 'not measured'),
    },
}


def get_config(arg=None):
  """The base config every cell starts from."""
  config = extrapolation.get_config(arg)
  if default.parse_arg(arg).get('code'):
    _use_code(config, arg)
  # FIRE's threshold starts at the training length: within it the bias is relative, beyond it the
  # progressive interpolation keeps the MLP's input in [0, 1] (the listing's 512 is for longer
  # training contexts; L is learned either way).
  config.model.fire_threshold = 64.0
  # xPos with the paper's blockwise causal attention at inference, blocks of the training length
  # (plain causal attention while training at L).
  config.model.xpos_block = 64
  return config


def _use_code(config, arg):
  """The data of configs/python_code.py (its quick corpus with `quick`) at L = 64; the toy
  study's model and schedule, for 2,000 steps (1.4 passes over the 2.9M training tokens)."""
  config.data = python_code.get_config(arg).data
  config.data.max_length = CODE_LENGTH  # the cells name it too
  if 'quick' in default.parse_arg(arg):  # the smoke form: 12 files a split, 2 layers
    config.data.code_max_files = 12
    config.model.num_layers = 2
  else:
    config.train.steps = CODE_STEPS
    config.train.eval_every = config.train.checkpoint_every = 500


def get_sweep(arg=None):
  """Cells: config overrides (dotted field -> value), seeds, and the eval.py flags per cell."""
  if default.parse_arg(arg).get('code'):
    return _code_sweep(arg)
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


def _code_sweep(arg):
  """:code: the 9 methods (randomized RoPE at N = 32L) and RoPE trained at 4L, 5 seeds; every
  cell evaluated at 64, 128, 256 and 512 tokens (the training length is in every cell's name, so
  that each length reads its own --lengths). `quick`: RoPE, randomized RoPE and the reference."""
  quick = 'quick' in default.parse_arg(arg)
  length = CODE_LENGTH  # L
  cells = [{'data.max_length': length, 'model.position': p}
           for p in (('rope',) if quick else POSITIONS)]
  cells.append({'data.max_length': length, 'model.position': 'rope',
                'model.random_positions_max': CODE_RANDOM_POSITIONS_MAX})
  # The same tokens per step (and so in all) as the cells at L: batch 32 x 64 = 8 x 256.
  cells.append({'data.max_length': REFERENCE_LENGTH, 'model.position': 'rope',
                'train.batch_size': REFERENCE_BATCH})
  # The first 128K tokens of the test split (of 211K; the quick corpus: 4K), to bound the cost.
  modes = ['--modes=non_overlapping,sliding', f'--stream_tokens={4096 if quick else 131072}']
  multiples = (1, 2) if quick else (1, 2, 4, 8)
  ref = [m * length / REFERENCE_LENGTH for m in multiples]
  return {
      'cells': cells,
      'seeds': [0, 1, 2, 3, 4],
      'eval_flags': {
          f'data.max_length={length}': [f'--lengths={",".join(map(str, multiples))}', *modes],
          f'data.max_length={REFERENCE_LENGTH}': [f'--lengths={",".join(f"{m:g}" for m in ref)}',
                                                  *modes]},
      'eval_variants': {f'model.random_positions_max={CODE_RANDOM_POSITIONS_MAX}':
                        ['--position_ids=random']},
  }
