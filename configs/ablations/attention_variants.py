"""Every attention variant (the keys of layers.attention_variants.VARIANTS), on the toy stream LM.

Run:     python -m tools.sweep --sweep=configs/ablations/attention_variants.py --sweep_dir=DIR
Compare: python -m tools.compare DIR --out=DIR/compare.png
"""

from configs import extrapolation

# The keys of layers.attention_variants.VARIANTS, by name: configs/ import no layers
# (tests/test_sweep.py checks the list against the registry).
VARIANTS = ('bigbird', 'dense', 'linear', 'linformer', 'longformer', 'performer', 'sliding_window')


def get_config(arg=None):
  """Decoder-only LM on the toy stream at L=64 (configs/extrapolation.py), RoPE positions."""
  return extrapolation.get_config(arg)


# Variants that cannot attend causally; in this decoder-only sweep they are trained as the
# bidirectional masked LM (arch encoder_only) on the same data instead.
NON_CAUSAL = ('linformer',)


def get_sweep():
  """One cell per variant."""
  cells = [{'model.attention': name} if name not in NON_CAUSAL else
           {'model.attention': name, 'model.arch': 'encoder_only', 'data.packing': 'none',
            'train.loss_on': 'all'}
           for name in VARIANTS]
  return {'cells': cells, 'seeds': [0]}
