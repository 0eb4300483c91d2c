"""Context extension by fine-tuning: RoPE trained at L=64, continued at 4L = 256 tokens.

The base cell trains configs/extrapolation.py (RoPE, L=64, 1,000 steps, three seeds). Each
fine-tune cell starts from its seed's base parameters (train.init_from; a fresh optimiser at step
0), sets data.max_length=256 and one RoPE scaling with factor s = 256 / 64 = 4 (none, PI, NTK,
YaRN), and trains 50 or 200 steps. The 0-step column is the base itself, evaluated with each
scaling applied at evaluation (eval_variants). Every cell is evaluated by the extrapolation
harness as usual, at 0.25, 1, 2 and 4 times its own training length in non-overlapping windows:
the base at 16, 64, 128 and 256 tokens, a fine-tune at 64 (the base's L), 256 (4L, the table's
column), 512 and 1,024. Sliding windows and 8x are left out: at 2,048 tokens they would cost more
than the fine-tuning, and the table reads non-overlapping windows only.

Run:     python -m tools.sweep --sweep=configs/ablations/context_extension.py --sweep_dir=DIR \
             --sweep_eval --parallel=2
A smoke run of the same cells, 25x shorter: --sweep=configs/ablations/context_extension.py:quick
"""

from configs import extrapolation

SCALINGS = ('none', 'pi', 'ntk', 'yarn')
FINE_TUNE_STEPS = (50, 200)
EXTENDED_LENGTH = 256

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/context_extension.md',
    'baseline': None,
    'metrics': ('final_valid', 'r2', 'r4'),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', '28.9 minutes'),
    },
}


def get_config(arg=None):
  """The base of every cell: configs/extrapolation.py with RoPE."""
  config = extrapolation.get_config(arg)
  config.model.position = 'rope'
  return config


def get_sweep(arg=None):
  """The base cell, then per fine-tune length and scaling one cell started from it; 3 seeds."""
  quick = 'quick' in (arg or '')
  base = {'data.max_length': 64}
  cells = [base]
  factor = EXTENDED_LENGTH / base['data.max_length']
  for steps in FINE_TUNE_STEPS:
    if quick:
      steps //= 25
    for scaling in SCALINGS:
      cell = {'train.init_from': {'cell': base},  # this seed's base cell, trained first
              'data.max_length': EXTENDED_LENGTH, 'model.rope_scaling': scaling,
              'train.steps': steps,
              # A fresh AdamW at a quarter of the base's peak rate, with a short warmup: the
              # parameters are trained, only the length is new. Evaluation and the checkpoint
              # come at the last step (eval_every, checkpoint_every > steps).
              'train.learning_rate': 5e-4, 'train.warmup_steps': 1 if quick else 5}
      if scaling != 'none':
        cell['model.rope_scaling_factor'] = factor
      cells.append(cell)
  scaled = [f'--rope_scaling={s}:{factor:g}' for s in SCALINGS if s != 'none']
  return {
      'cells': cells,
      'seeds': [0, 1, 2],
      'eval_flags': ['--lengths=0.25,1,2,4', '--modes=non_overlapping'],
      # Fine-tuning for 0 steps: the base with each scaling applied at evaluation only.
      'eval_variants': {f'data.max_length={base["data.max_length"]}': scaled},
  }
