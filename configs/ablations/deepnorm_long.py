"""Does DeepNorm catch up with Pre-LN given time and its own learning rate? 12 layers, 2,000 steps.

In the depth study (configs/ablations/depth.py: 500 steps at one shared rate, 1e-3) DeepNorm at 12
layers ends 0.41-0.49 nats above Pre-LN. The DeepNet paper (Wang et al. 2022) trains its models
far longer and implies that DeepNorm's beta-scaled init costs speed at the start, not the final
loss. Here three 12-layer cells train 4x longer, each at its own best learning rate:

- deepnorm: Post-LN with the residual up-weighted by alpha and the beta-scaled init;
- pre: Pre-LN;
- post: Post-LN, which needs the warmup to train at depth 12 at all.

Every cell has the same 100 linear warmup steps (DeepNet trains with warmup too), then a constant
rate; the rest is the depth study's base (decoder-only LM on the toy stream, d_model 64, 4 heads,
plain Adam with b2 0.999, no clipping, batch 32, L=64). Tune the rate with the sweep's tuning axis,
which trains every cell once per rate at seed 0 and its other seeds at the rate with the lowest
final validation loss:

Run:     python -m tools.sweep --sweep=configs/ablations/deepnorm_long.py --sweep_dir=DIR \
             --tune=train.learning_rate:5e-4,1e-3,2e-3,4e-3 --parallel=2
Compare: python -m tools.compare DIR --logy --target_loss=2.0 --target_split=train
A smoke run of the same cells with a few steps each:
    --sweep=configs/ablations/deepnorm_long.py:quick

Which scaling makes DeepNorm start slowly? `:scales` trains DeepNorm with both scalings, alpha
alone and beta alone (model.deepnorm_scales) for the first 500 steps, at the rate the tuning above
chose for DeepNorm (2e-3), 3 seeds; the rate is constant after the warmup, so step 500 here is step
500 of the long runs:

Run:     python -m tools.sweep --sweep=configs/ablations/deepnorm_long.py:scales --sweep_dir=DIR2 \
             --parallel=2
"""

from configs import default
from configs.ablations import depth

NORM_POSITIONS = ['deepnorm', 'pre', 'post']
LAYERS, STEPS, WARMUP = 12, 2000, 100
SCALES_STEPS, SCALES_RATE = 500, 2e-3  # :scales, the start alone at DeepNorm's tuned rate
DEEPNORM_SCALES = ['alpha_beta', 'alpha', 'beta']  # both (the paper), alpha alone, beta alone
OTHER_ARGS = ('scales', 'scales,quick')  # the sweep file's other forms (tests/unit/test_sweep.py)

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/deepnorm_long.md',
    'baseline': {'model.norm_position': 'pre'},
    'metrics': ('final_valid',),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', '66 minutes at --parallel=2 on a shared machine'),
        'scales': ('scales', 'not measured', {'model.deepnorm_scales': 'alpha_beta'}),
    },
}


def get_config(arg=None):
  """The depth study's base at 12 layers, 2,000 steps and 100 warmup steps (`scales`: 500 steps
  at 2e-3; `quick`: a hundredth of the steps)."""
  args = default.parse_arg(arg)
  rest = ','.join(k if v is True else f'{k}={v}' for k, v in args.items() if k != 'scales')
  config = depth.get_config(rest or None)
  quick = bool(args.get('quick'))
  config.model.num_layers = LAYERS
  steps = SCALES_STEPS if args.get('scales') else STEPS
  config.train.steps = steps // 100 if quick else steps
  if args.get('scales'):
    config.train.learning_rate = SCALES_RATE
  config.train.warmup_steps = WARMUP // 100 if quick else WARMUP
  config.train.eval_every = 10 if quick else 250
  return config


def get_sweep(arg=None):
  """{deepnorm, pre, post} at 12 layers, 3 seeds (the rate: --tune); with `scales`: DeepNorm with
  each of model.deepnorm_scales."""
  if default.parse_arg(arg).get('scales'):
    return {'grid': {'model.norm_position': ['deepnorm'],
                     'model.deepnorm_scales': DEEPNORM_SCALES},
            'seeds': [0, 1, 2]}
  return {'grid': {'model.norm_position': NORM_POSITIONS}, 'seeds': [0, 1, 2]}
