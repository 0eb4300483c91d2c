"""Attention variants on multi-query associative recall (Zoology, Arora et al. 2023): which
variants can look a key up, by number of pairs and by key-query distance?

configs/mqar.py (decoder-only, 2 layers, D = 64, 4 heads, RoPE; rows of L = 128 tokens with 16
key-value pairs, every key asked again in the noise after them; 2,000 steps). Zoology found that
attention solves MQAR at small width while a fixed-size state (linear attention, gated
convolutions) fails as the pairs grow. Each variant trains on 16 pairs; eval.py's `recall` scores
it at 4, 8, 16 and 32 pairs (the curve over difficulty) and by key-query distance.

The variants (decoder-only, so causal forms; Linformer has none): dense, GQA (2 KV heads), MQA
(1), a sliding window of 16 tokens (a query sees the 16 before it: the context's pairs lie up to
127 tokens back), Longformer (the same window and a global <bos>), BigBird (blocks of 16, two
random blocks), Performer (64 random features), linear attention (elu + 1). `:width` adds D = 128
for dense and linear (Zoology's axis: a wider state holds more pairs).

Run:     python -m tools.sweep --sweep=configs/ablations/mqar_attention.py --sweep_dir=DIR \
             --sweep_eval [--seeds=0,1,2]
Compare: python -m tools.compare DIR --baseline=attention=dense,num_kv_heads=4
Smoke:   --sweep=configs/ablations/mqar_attention.py:quick (a few steps a cell)
`:pair` runs the dense and linear cells alone (the same cell names: more seeds of the headline
contrast without the other variants).
"""

from configs import default
from configs import mqar

# Cells: (attention, KV heads; None = as many as the query heads).
VARIANTS = (('dense', None), ('dense', 2), ('dense', 1), ('sliding_window', None),
            ('longformer', None), ('bigbird', None), ('performer', None), ('linear', None))
CELL_ARGS = ('width', 'pair')  # choose the cells (get_sweep), not the config
WIDTHS = (64, 128)  # :width: dense and linear at each
OTHER_ARGS = ('width', 'width,quick', 'pair', 'pair,quick')  # the sweep file's other forms
                                                             # (tests/unit/test_sweep.py)

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/mqar_attention.md',
    'baseline': {'model.attention': 'dense'},
    'metrics': ('accuracy.test', 'recall_pairs@16', 'recall_pairs@32'),
    'forms': {
        'smoke': ('quick', '10 minutes at --seeds=0,1 (16 cells, 33-44 s each with eval)'),
        'full': ('', '100 minutes at --parallel=2 (8 cells x 5 seeds, with their evaluations)'),
        'width': ('width', 'not measured', {'model.attention': 'dense', 'model.d_model': 64}),
        'pair': ('pair', 'not measured'),
    },
}


def get_config(arg=None):
  """configs/mqar.py with each variant's sizes set for 128-token rows (`quick` passed on)."""
  args = default.parse_arg(arg)
  for name in CELL_ARGS:  # read here too: train.py refuses an argument its config does not read
    args.get(name)
  passed = {k: args.get(k) for k in ('quick', 'size') if k in args}  # configs/mqar.py's own
  rest = ','.join(k if v is True else f'{k}={v}' for k, v in passed.items())
  config = mqar.get_config(rest or None)
  m = config.model
  m.window = 16
  m.global_tokens = (0,)
  # Blocks of 16 at the quick form's 32 tokens would leave BigBird nothing to hide (its window of
  # blocks and two random ones cover both): 4-token blocks keep it sparse there.
  m.bigbird_block = 4 if config.data.max_length < 128 else 16
  m.bigbird_random_blocks = 2
  m.performer_features = 64
  return config


def get_sweep(arg=None):
  """One cell per variant (`:width`: dense and linear at each width), 5 seeds; eval.py scores
  recall by pairs and distance."""
  args = default.parse_arg(arg)
  if args.get('width'):
    cells = [{'model.attention': name, 'model.d_model': width, 'model.d_ff': 4 * width}
             for name in ('dense', 'linear') for width in WIDTHS]
  elif args.get('pair'):  # the headline pair alone (more seeds at less cost)
    cells = [{'model.attention': name} for name in ('dense', 'linear')]
  else:
    cells = [{'model.attention': name, **({} if kv is None else {'model.num_kv_heads': kv})}
             for name, kv in VARIANTS]
  return {'cells': cells, 'seeds': [0, 1, 2, 3, 4], 'eval_flags': []}
