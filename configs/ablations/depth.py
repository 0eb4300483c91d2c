"""Deep Post-LN made trainable: five norm placements x depth 6, 12, 24 x with and without warmup.

The placements (layers/block.py): post (Post-LN), pre (Pre-LN), deepnorm (DeepNet, Wang et al.
2022: Post-LN with the residual up-weighted by alpha and a beta-scaled init), sandwich (CogView's
Sandwich-LN) and rezero (ReZero: no norm, a gate initialised at 0 per sublayer). The question: which
of them train at depth without learning-rate warmup, where plain Post-LN stalls at the unigram loss
(configs/ablations/postln_vs_preln.py, README)?

The base is the Post-LN vs Pre-LN study's (decoder-only LM on the toy stream, d_model 64, 4 heads,
Adam b2 0.999, no weight decay, no clipping, batch 32, L=64, a constant rate after the optional
linear warmup), at the rate that study used at depth 12 (1e-3) for every depth, so that only the
depth changes along that axis; 500 steps, with 0 or 100 warmup steps. 5 x 3 x 2 cells, 3 seeds:
90 runs. Compare the init gradient norms per block too (DIR/<cell>/init_grad_norms.json), and the
ReZero gates in the diagnostics (gate_self/..., gate_ffn/...).

Run:     python -m tools.sweep --sweep=configs/ablations/depth.py --sweep_dir=DIR
Compare: python -m tools.compare DIR --out=DIR/compare.png --logy
           --color_by=model.norm_position --style_by=model.num_layers
A smoke run of the same cells with a few steps each: --sweep=configs/ablations/depth.py:quick
"""

from configs.ablations import postln_vs_preln

NORM_POSITIONS = ['post', 'pre', 'deepnorm', 'sandwich', 'rezero']
DEPTHS = [6, 12, 24]
STEPS, WARMUP = 500, 100

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/depth.md',
    'baseline': None,
    'metrics': ('final_valid',),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', 'about 77 minutes of wall clock'),
    },
}


def get_config(arg=None):
  """The base of every cell: the Post-LN vs Pre-LN study's, at lr 1e-3 and 500 steps."""
  config = postln_vs_preln.get_config(arg)
  config.train.learning_rate = 1e-3
  config.train.steps = STEPS // 50 if 'quick' in (arg or '') else STEPS
  return config


def get_sweep(arg=None):
  """{post, pre, deepnorm, sandwich, rezero} x {6, 12, 24 layers} x {no warmup, warmup}, 3 seeds."""
  warmup = WARMUP // 50 if 'quick' in (arg or '') else WARMUP
  return {'grid': {'model.norm_position': NORM_POSITIONS, 'model.num_layers': DEPTHS,
                   'train.warmup_steps': [0, warmup]},
          'seeds': [0, 1, 2]}
