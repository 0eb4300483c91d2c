"""The attention variants of 2024-26 against dense attention: recall, real code, sinks, stability.

Four forms, each 3 seeds (tools.compare gives 95% intervals and tests against the baseline):

- default (recall): configs/mqar.py (2 layers, D = 64, 4 heads, 16 pairs in rows of 128 tokens),
  eval.py's recall by number of pairs. Dense, GQA (2 KV heads), MLA (latent 32 + rotary key 8 = 40
  cached numbers per token against dense's 128), differential, linear attention, Gated DeltaNet and
  a hybrid (`gated_deltanet,dense`: one layer of each at this depth). Expected from the papers:
  the delta rule recalls far better than linear attention with a state of the same size, and the
  hybrid comes close to dense.
- `:code`: configs/python_code.py (4 layers, D = 128, the stdlib's code), loss and loss by
  position (eval.py --lengths=1: each position of the windows of the training length): dense
  against the output gate (elementwise, Qiu et al.'s best), the sinks, QK-norm with the logit soft
  cap at 50, differential, MLA at the dense layer's parameters (latent 64: 67,648 against 65,536
  per layer) and Qwen3-Next's 3:1 hybrid. The diagnostics log the first-token attention share
  (attn_sink_share) of every softmax layer: does the gate remove the sink, do the sinks take it?
- `:stability`: configs/python_code.py at 1x, 4x and 8x the learning rate (1e-3) for dense,
  QK-norm and the soft cap: does either train where dense diverges?

Run:     python -m tools.sweep --sweep=configs/ablations/attention_2024.py[:code|:stability] \
             --sweep_dir=DIR --sweep_eval
Compare: python -m tools.compare DIR --baseline=attention=dense \
             [--metrics=attn_sink_share]  (the stability form: --baseline=learning_rate=0.001)
Smoke:   :quick, :code,quick, :stability,quick (a few steps a cell)
Pair:    :pair, the recall form's linear attention and Gated DeltaNet alone (extra seeds)
Hybrid:  :hybrid, the recall form's hybrid against dense alone
Softmax: :softmax, the recall form's GQA, MLA and differential alone (extra seeds)
Short:   :code,short and :stability,short, the code and stability forms at a budget a 2-core
         machine runs in minutes (batch 8: 2,048 tokens a step, 1,000 steps; the full code form
         takes about an hour a cell there)
Sinks:   :sinks, the short code form's dense, gate and sinks cells alone
"""

from configs import default
from configs import mqar
from configs import python_code

# choose the config and the cells
CELL_ARGS = ('code', 'stability', 'pair', 'hybrid', 'softmax', 'sinks', 'short')
# the forms test_sweep.py expands besides the default and quick
OTHER_ARGS = ('code', 'code,quick', 'code,short', 'stability', 'stability,quick', 'stability,short',
              'pair', 'hybrid', 'softmax', 'sinks')
SEEDS = [0, 1, 2]
HYBRID_RECALL = 'gated_deltanet,dense'  # 2 layers: one recurrent, one dense
HYBRID_CODE = 'gated_deltanet,gated_deltanet,gated_deltanet,dense'  # Qwen3-Next's 3:1
MLA_RECALL_RANK = 32  # d_c at D = 64: with the rotary key (H/2 = 8), 40 numbers a token
MLA_CODE_RANK = 64  # d_c at D = 128: the layer's parameters within 3% of dense's
LEARNING_RATES = (1e-3, 4e-3, 8e-3)  # :stability: the tuned rate, 4x and 8x
# the short forms and :sinks: a quarter of :code's tokens a step, half its steps
SHORT_BATCH, SHORT_STEPS = 8, 1000

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/attention_2024.md',
    'baseline': {'model.attention': 'dense'},
    'metrics': ('accuracy.test', 'recall_pairs@16', 'final_valid'),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', 'not measured'),
        'code': ('code', '8-14 minutes a run, two at a time'),
        'stability': ('stability', 'not measured', {'train.learning_rate': 0.001}),
    },
}


def get_config(arg=None):
  """configs/mqar.py, or with `code`/`stability` configs/python_code.py (`quick` passed on)."""
  args = default.parse_arg(arg)
  for name in CELL_ARGS:  # read here too: train.py refuses an argument its config does not read
    args.get(name)
  passed = ','.join(k if v is True else f'{k}={v}' for k, v in args.items()
                    if k in ('quick', 'size')) or None
  if args.get('short') and not (args.get('code') or args.get('stability')):
    raise ValueError("short shortens the code and stability forms; valid: 'code,short', "
                     "'stability,short'")
  if args.get('code') or args.get('stability') or args.get('sinks'):
    config = python_code.get_config(passed)
    short = args.get('sinks') or args.get('short')
    if short and not args.get('quick'):
      config.train.batch_size = SHORT_BATCH
      config.train.steps = SHORT_STEPS
      config.train.warmup_steps = SHORT_STEPS // 10
  else:
    config = mqar.get_config(passed)
  config.train.diagnostics = True  # the sink share of every softmax layer
  return config


def get_sweep(arg=None):
  """The cells of the chosen form, 3 seeds."""
  args = default.parse_arg(arg)
  if args.get('stability'):
    cells = [{'train.learning_rate': lr, **extra} for lr in LEARNING_RATES
             for extra in ({}, {'model.qk_norm': 'rmsnorm'}, {'model.attn_logit_softcap': 50.0})]
  elif args.get('code') or args.get('sinks'):  # loss and loss by position
    cells = [{'model.attention': 'dense'},
             {'model.attention_gate': 'elementwise'},
             {'model.attention_sinks': True},
             {'model.qk_norm': 'rmsnorm', 'model.attn_logit_softcap': 50.0},
             {'model.attention': 'differential'},
             {'model.attention': 'mla', 'model.mla_kv_rank': MLA_CODE_RANK},
             {'model.layer_pattern': HYBRID_CODE}]
    if args.get('sinks'):  # dense, the gate and the sinks alone
      cells = cells[:3]
    # the loss at each position of the training length's windows (tools.compare: loss_pos@a-b)
    return {'cells': cells, 'seeds': SEEDS,
            'eval_flags': ['--lengths=1', '--modes=non_overlapping']}
  elif args.get('pair'):  # the recall form's headline pair alone (more seeds where time is short)
    cells = [{'model.attention': 'linear'}, {'model.attention': 'gated_deltanet'}]
  elif args.get('hybrid'):  # the recall form's hybrid and its baseline alone
    cells = [{'model.attention': 'dense'}, {'model.layer_pattern': HYBRID_RECALL}]
  else:
    softmax = [{'model.attention': 'dense', 'model.num_kv_heads': 2},
               {'model.attention': 'mla', 'model.mla_kv_rank': MLA_RECALL_RANK},
               {'model.attention': 'differential'}]
    if args.get('softmax'):  # the recall form's variants of 2024 alone (more seeds)
      return {'cells': softmax, 'seeds': SEEDS, 'eval_flags': []}
    cells = [{'model.attention': 'dense'}, *softmax,
             {'model.attention': 'linear'},
             {'model.attention': 'gated_deltanet'},
             {'model.layer_pattern': HYBRID_RECALL}]
  return {'cells': cells, 'seeds': SEEDS, 'eval_flags': []}
