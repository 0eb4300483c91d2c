"""Passkey retrieval beyond the training length: every position method, then RoPE extended by
fine-tuning with none/PI/NTK/YaRN.

Every base cell trains configs/passkey.py (decoder-only, 2 layers, d_model 64, L = 64, the key at a
uniform depth, the loss on the value alone) for 2,000 steps with one position method: alibi, rope,
sinusoidal, nope, t5_bias, fire, xpos (plain causal attention: a blockwise window of L would hide
every key more than a block back by construction), kerple, and RoPE with randomized positions
(Ruoss et al. 2023: sorted ids from [0, 8L) while training). `learned` is left out: its table has L
rows, so nothing beyond L can be asked of it. 9 x 3 seeds.

eval.py reports the retrieval accuracy at 1, 2, 4, 8 x L (64-512 tokens) and depths 0-100%. The
RoPE base is evaluated again with each scaling applied at evaluation only (factor 4: the 0-step
fine-tune), and the randomized-positions cells at sorted random ids and at ids spaced by 8L/T, as
they trained (eval_variants).

Then each RoPE base is fine-tuned at 4L = 256 tokens (train.init_from: its parameters, a fresh
optimiser) with rope_scaling none, pi, ntk or yarn (factor 4), for 50 and 200 steps, and evaluated
at 64 and 256 tokens. 4 x 2 x 3 seeds.

Run:     python -m tools.sweep --sweep=configs/ablations/passkey_positions.py --sweep_dir=DIR \
             --sweep_eval --parallel=2
Compare: python -m tools.compare DIR --out=DIR/compare.png   (the retrieval table and heat maps)
A smoke run of the same cells, a few steps each:
    --sweep=configs/ablations/passkey_positions.py:quick
"""

from configs import passkey
from configs.ablations import rope_vs_alibi

STEPS = 2000
RANDOM_POSITIONS_MAX = 512  # 8L: every evaluated length's ids are drawn at some training step
SCALINGS = ('none', 'pi', 'ntk', 'yarn')
FINE_TUNE_STEPS = (50, 200)
EXTENDED_LENGTH = 256  # 4L

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/passkey.md',
    'baseline': None,
    'metrics': ('retrieval@64', 'retrieval@128', 'retrieval@256'),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', '122 minutes at --parallel=2'),
    },
}


def get_config(arg=None):
  """configs/passkey.py for 2,000 steps (the quick form: a few steps, a small model)."""
  config = passkey.get_config(arg)
  quick = 'quick' in (arg or '')
  config.train.steps = 20 if quick else STEPS
  # FIRE's threshold starts at the training length (the position study's setting).
  config.model.fire_threshold = float(config.data.max_length)
  return config


def get_sweep(arg=None):
  """The 9 position cells, then the RoPE fine-tunes started from the RoPE cell; 3 seeds.

  The quick form (the tests' smoke run) keeps one cell of each kind: RoPE, randomized RoPE and the
  2-step fine-tune with YaRN, each evaluated on 2 examples per depth.
  """
  quick = 'quick' in (arg or '')
  rope = {'model.position': 'rope', 'model.rope_scaling': 'none'}
  randomized = {'model.position': 'rope', 'model.random_positions_max': RANDOM_POSITIONS_MAX}
  others = [] if quick else [p for p in rope_vs_alibi.POSITIONS if p != 'rope']
  cells = [{'model.position': p} for p in others] + [rope, randomized]
  factor = EXTENDED_LENGTH / passkey.get_config(arg).data.max_length
  for steps in FINE_TUNE_STEPS[:1] if quick else FINE_TUNE_STEPS:
    for scaling in SCALINGS[-1:] if quick else SCALINGS:
      cell = {'train.init_from': {'cell': rope}, 'data.max_length': EXTENDED_LENGTH,
              'model.rope_scaling': scaling, 'train.steps': steps // 25 if quick else steps,
              # A fresh AdamW at a quarter of the base's peak rate after a short warmup (the
              # context-extension study's recipe); one evaluation and checkpoint at the end.
              'train.learning_rate': 5e-4, 'train.warmup_steps': 1 if quick else 5}
      if scaling != 'none':
        cell['model.rope_scaling_factor'] = factor
      cells.append(cell)
  scaled = [f'--rope_scaling={s}:{factor:g}' for s in (SCALINGS[-1:] if quick else SCALINGS[1:])]
  return {
      'cells': cells,
      'seeds': [0] if quick else [0, 1, 2],
      # The base cells: the default report, 1, 2, 4, 8 x L; the fine-tunes (L = 256): 64 and 256.
      'eval_flags': {'': ['--retrieval_examples=2'] if quick else [],
                     f'data.max_length={EXTENDED_LENGTH}': ['--lengths=0.25,1']},
      'eval_variants': {
          'model.position=rope,model.rope_scaling=none': scaled,
          f'model.random_positions_max={RANDOM_POSITIONS_MAX}': ['--position_ids=random',
                                                                 '--position_ids=spaced'],
      },
  }
