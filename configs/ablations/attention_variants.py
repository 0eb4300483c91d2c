"""Every attention variant registered in layers.attention.VARIANTS, on the toy stream LM.

Run:     python train.py --sweep=configs/ablations/attention_variants.py --sweep_dir=DIR
Compare: python eval.py --compare=DIR --out=DIR/compare.png
"""

from configs import extrapolation
from layers import attention


def get_config(arg=None):
  """Decoder-only LM on the toy stream at L=64 (configs/extrapolation.py), RoPE positions."""
  return extrapolation.get_config(arg)


def get_sweep():
  """One cell per variant known when this file is read (new variants join automatically)."""
  return {'grid': {'model.attention': sorted(attention.VARIANTS)}, 'seeds': [0]}
