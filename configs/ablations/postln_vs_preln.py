"""Post-LN vs Pre-LN, with and without learning-rate warmup, at depth 6 and 12 (Xiong et al. 2020).

Decoder-only LM on the toy stream (attention across pairs, loss on every token), d_model 64,
4 heads, Adam (beta2 0.999, no weight decay, no gradient clipping), batch 32, L=64, a constant
learning rate after the (optional) linear warmup. The question: does Post-LN train without
warmup, and at depth 12?
Compare the init gradient norms per layer too (DIR/<cell>/init_grad_norms.json): Post-LN's grow
toward the top layers, Pre-LN's stay flat.

Run:     python -m tools.sweep --sweep=configs/ablations/postln_vs_preln.py --sweep_dir=DIR
Compare: python -m tools.compare DIR --out=DIR/compare.png --logy
A smoke run of the same cells with a few steps each:
  --sweep=configs/ablations/postln_vs_preln.py:quick

`:code` asks the same on real code (data.task=python_code, the local Python stdlib's source, L = 64,
vocabulary 4,000): Post-LN and Pre-LN at 6 and 12 layers, each with and without 100 warmup steps,
lr 1e-3, 1,000 steps, 5 seeds (`:code,quick`: the smoke form).
Compare: python -m tools.compare DIR --baseline=CELL --out=DIR/compare.png --logy
"""

from configs import default
from configs import extrapolation
from configs import python_code

OTHER_ARGS = ('code', 'code,quick')  # the sweep file's other forms (tests/unit/test_sweep.py)
# :code: (num_layers, learning_rate, steps, warmup_steps), each Post-LN and Pre-LN
CODE_SETTINGS = [(layers, 1e-3, 1000, warmup) for layers in (6, 12) for warmup in (0, 100)]

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/postln_vs_preln.md',
    'baseline': None,
    'metrics': ('final_valid',),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', '32 minutes on a shared 2-core machine'),
        'code': ('code', 'about 100 minutes'),
    },
}


def get_config(arg=None):
  """The base of every cell (the cells set depth, norm position, learning rate, steps, warmup)."""
  config = extrapolation.get_config(arg)
  config.model.position = 'sinusoidal'  # the original Transformer's, as in Xiong et al.
  config.model.num_layers = 6
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.train.b2 = 0.999
  config.train.weight_decay = 0.0  # plain Adam
  config.train.schedule = 'constant'
  config.train.grad_clip_norm = 0.0  # clipping would hide the Post-LN instability under study
  config.train.batch_size = 32
  config.train.log_every = 10  # a spike must be visible in the curve
  config.train.eval_every = 100
  config.train.eval_batches = 4
  if default.parse_arg(arg).get('code'):
    config.data = python_code.get_config(arg).data
    config.data.max_length = 64
    if 'quick' in default.parse_arg(arg):
      config.data.code_max_files = 12  # the smoke form's corpus
  return config


def get_sweep(arg=None):
  """The cells of the study (not a full grid), each Post-LN and Pre-LN, three seeds."""
  # (num_layers, learning_rate, steps, warmup_steps, norm positions)
  settings = [
      (6, 2e-3, 500, 0, ('post', 'pre')),  # no warmup at a high rate
      (6, 2e-3, 1000, 100, ('post', 'pre')),  # with warmup ...
      (6, 2e-3, 1000, 0, ('pre',)),  # ... and Pre-LN without it, as its control
      (12, 1e-3, 500, 0, ('post', 'pre')),  # depth 12, no warmup
      (6, 1e-3, 500, 0, ('post', 'pre')),  # a lower rate, no warmup
  ]
  quick = 'quick' in (arg or '')
  if default.parse_arg(arg).get('code'):
    settings = [(*s, ('post', 'pre')) for s in CODE_SETTINGS]
  cells = []
  for layers, lr, steps, warmup, norm_positions in settings:
    if quick:  # the same cells, 50x shorter
      steps, warmup = steps // 50, warmup // 50
    for norm_position in norm_positions:
      cells.append({'model.num_layers': layers, 'model.norm_position': norm_position,
                    'train.learning_rate': lr, 'train.steps': steps,
                    'train.warmup_steps': warmup})
  code = default.parse_arg(arg).get('code')
  return {'cells': cells, 'seeds': [0, 1, 2, 3, 4] if code else [0, 1, 2]}
