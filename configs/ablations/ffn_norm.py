"""Feed-forward activation (relu, gelu, swiglu, geglu) x normalisation (layernorm, rmsnorm).

Run:     python -m tools.sweep --sweep=configs/ablations/ffn_norm.py --sweep_dir=DIR
Compare: python -m tools.compare DIR --out=DIR/compare.png
The gated FFNs (swiglu, geglu) have a third projection: the table's parameter column shows it.
"""

from configs import extrapolation

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/sweeps.md',
    'baseline': None,
    'metrics': ('final_valid',),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', 'not measured'),
    },
}


def get_config(arg=None):
  """Decoder-only LM on the toy stream at L=64 (configs/extrapolation.py)."""
  return extrapolation.get_config(arg)


def get_sweep():
  """The full 4 x 2 grid, one seed."""
  return {'grid': {'model.ffn': ['relu', 'gelu', 'swiglu', 'geglu'],
                   'model.norm': ['layernorm', 'rmsnorm']},
          'seeds': [0]}
