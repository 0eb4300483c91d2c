"""Mixture-of-experts routing: dense vs MoE, top-k, capacity, balancing, shared experts, routing.

The decoder cells train configs/extrapolation.py (a decoder-only LM on the toy stream, L = 64,
6 layers, d_model 64, 1,000 steps), the dense FFN of width 256 against MoE blocks of 8 experts of
width 128 in every layer:

  dense            d_ff 256: the MoE's active FFN parameters (k = 2 experts of 128)
  dense_total      d_ff 1024: the MoE's total FFN parameters (8 experts of 128)
  moe              top-2, capacity factor 1.25, auxiliary loss 0.01 (the reference MoE cell)
  top1             top-1, the expert weighed by its unnormalised gate (Switch)
  cf1.0, cf2.0, dropless   capacity factor 1.0, 2.0, none (ragged_dot)
  aux_free         no auxiliary loss; DeepSeek-V3's selection bias, gamma = 0.001
  shared           one always-on shared expert of width 128 beside the 8

`:encoder` runs the routing cells on configs/encoder_only.py (masked tokens of the toy
translation pairs, 1,000 steps), where expert choice is allowed: token choice (top-2, capacity
factor 1.25) against expert choice with capacity factor 1.0 (each expert takes 2·T/8 tokens of a
row: two experts per token on average, top-2's compute).

Run:     python -m tools.sweep --sweep=configs/ablations/moe.py --sweep_dir=DIR --parallel=2
         python -m tools.sweep --sweep=configs/ablations/moe.py:encoder --sweep_dir=DIR_ENC \\
             --parallel=2
Compare: python -m tools.compare DIR --target_loss=T --color_by=none \\
             --metrics=moe_drop_fraction,moe_load_cv
A smoke run of the same cells, one seed and a few steps: append `quick` (`:quick`,
`:encoder,quick`).
"""

from configs import default
from configs import encoder_only
from configs import extrapolation

EXPERTS = 8
EXPERT_WIDTH = 128  # top-2 of them: the dense d_ff of 256
MOE = {'model.moe_experts': EXPERTS, 'model.moe_d_ff': EXPERT_WIDTH, 'model.moe_top_k': 2,
       'model.moe_capacity_factor': 1.25}

DECODER_CELLS = {
    'dense': {'model.d_ff': 2 * EXPERT_WIDTH},
    'dense_total': {'model.d_ff': EXPERTS * EXPERT_WIDTH},
    'moe': MOE,
    'top1': {**MOE, 'model.moe_top_k': 1},
    'cf1.0': {**MOE, 'model.moe_capacity_factor': 1.0},
    'cf2.0': {**MOE, 'model.moe_capacity_factor': 2.0},
    'dropless': {**MOE, 'model.moe_capacity_factor': 0.0},
    'aux_free': {**MOE, 'model.moe_aux_loss': 0.0, 'model.moe_bias_rate': 1e-3},
    'shared': {**MOE, 'model.moe_shared_experts': 1},
}
# The sweep's other arguments (tests/unit/test_sweep.py expands each into valid configs).
OTHER_ARGS = ('encoder', 'encoder,quick')
ENCODER_CELLS = {
    'token_choice': MOE,
    'expert_choice': {**MOE, 'model.moe_routing': 'experts', 'model.moe_capacity_factor': 1.0},
}

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/moe.md',
    'baseline': {'model.d_ff': 256},
    'metrics': ('final_valid',),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', 'about 110 minutes'),
        'encoder': ('encoder', 'not measured', {'model.moe_capacity_factor': 1.25}),
    },
}


def get_config(arg=None):
  """configs/extrapolation.py, or with `encoder` in `arg` configs/encoder_only.py at 1,000
  steps (`quick`: a few steps)."""
  args = default.parse_arg(arg)
  rest = ','.join(k if v is True else f'{k}={v}' for k, v in args.items() if k != 'encoder')
  if not args.get('encoder'):
    return extrapolation.get_config(rest or None)
  config = encoder_only.get_config(rest or None)
  if not args.get('quick'):
    config.train.steps = 1000
  return config


def get_sweep(arg=None):
  """The decoder cells (or with `encoder` the routing cells), 3 seeds (`quick`: one)."""
  args = default.parse_arg(arg)
  cells = ENCODER_CELLS if args.get('encoder') else DECODER_CELLS
  return {'cells': list(cells.values()), 'seeds': [0] if args.get('quick') else [0, 1, 2]}
