"""Does MoE buy capacity? Dense and mixture-of-experts feed-forwards on the memorisation task.

configs/memorize.py: a fixed map of 65,536 keys (two tokens each) to 256 values that no row
states, so the test accuracy is the share of the map the parameters hold (MAD, Poli et al. 2024).
Switch (Fedus et al. 2021) and GShard (Lepikhin et al. 2020) report MoE better than dense at
equal active compute; on the toy stream every cell tied, dense at 2.9x the parameters included,
because that task has no use for capacity. Here:

- dense, d_ff 256: the active size of the MoE cells' experts;
- dense, d_ff 1,024: equal total feed-forward parameters to 4 experts of 256;
- MoE, 4 experts of 256, top-1 (Switch's form: the expert weighed by its gate): equal active
  parameters to dense 256, equal total to dense 1,024;
- MoE, 4 experts of 256, top-2: twice the active parameters of top-1.

Every MoE cell has capacity factor 2.0 in training (dropless at evaluation) and the auxiliary
load-balancing loss 0.01.

Run:     python -m tools.sweep --sweep=configs/ablations/memorize_moe.py --sweep_dir=DIR \
             --sweep_eval
Compare: python -m tools.compare DIR \
             --baseline=d_ff=256,moe_capacity_factor=0.0,moe_experts=0,moe_top_k=2
Smoke:   --sweep=configs/ablations/memorize_moe.py:quick
"""

from configs import memorize

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/memorize_moe.md',
    'baseline': {'model.d_ff': 256},
    'metrics': ('accuracy.test', 'final_valid'),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', 'not measured'),
    },
}


def get_config(arg=None):
  return memorize.get_config(arg)


def get_sweep(arg=None):
  """Four cells, 5 seeds."""
  del arg
  moe = {'model.d_ff': 256, 'model.moe_experts': 4, 'model.moe_capacity_factor': 2.0}
  cells = [{'model.d_ff': 256}, {'model.d_ff': 1024}, {**moe, 'model.moe_top_k': 1},
           {**moe, 'model.moe_top_k': 2}]
  return {'cells': cells, 'seeds': [0, 1, 2, 3, 4], 'eval_flags': []}
