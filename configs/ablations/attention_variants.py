"""Every attention variant (the keys of layers.attention_variants.VARIANTS) on the toy
translation task.

The quality half of the efficient-attention trade-off (tools/attention_tradeoff.py draws it
against each kernel's cost):

    python -m tools.sweep --sweep=configs/ablations/attention_variants.py --sweep_dir=DIR \
        --parallel=2 --sweep_eval
    python -m tools.attention_tradeoff --sweep_dir=DIR --costs=benchmarks/attention_variants.json

Encoder-decoder (configs/encoder_decoder.py: 2 + 2 layers, d_model 128, 1,500 steps): each variant
runs in its bidirectional form in the encoder and its causal form in the decoder. Linformer has no
causal form (its projection mixes future positions), so its decoder is dense; Gated DeltaNet has
only a causal form (a recurrence), so it runs in the decoder under a dense encoder.
"""

from configs import encoder_decoder

# The keys of layers.attention_variants.VARIANTS, by name: configs/ import no layers
# (tests/unit/test_sweep.py checks the list against the registry).
VARIANTS = ('bigbird', 'dense', 'differential', 'gated_deltanet', 'linear', 'linformer',
            'longformer', 'mla', 'performer', 'sliding_window')

# Variants with no causal form: their decoder is this one.
NON_CAUSAL = {'linformer': 'dense'}
# Variants with only a causal form: they run in the decoder, under this encoder.
CAUSAL_ONLY = {'gated_deltanet': 'dense'}

# What tools.study runs and reports (tools/study/declared.py).
STUDY = {
    'page': 'docs/studies/attention_variants.md',
    'baseline': {'model.attention': 'dense'},
    'metrics': ('final_valid', 'loss.test'),
    'forms': {
        'smoke': ('quick', 'not measured'),
        'full': ('', 'not measured'),
    },
}


def get_config(arg=None):
  """configs/encoder_decoder.py with each variant's sizes scaled to its 24-token rows.

  At the defaults (window 16, blocks of 16, Linformer k 32) every variant would see nearly every
  token of a 24-token row and the comparison would measure nothing; these keep each one sparse or
  low-rank at this length: a window of 4 (9 keys in the encoder, 5 in the decoder), BigBird blocks
  of 4 with 1 random block, Linformer k = 8 over a projection 64 long (test_long rows reach 26
  tokens), Performer 32 features (= head_dim).
  """
  config = encoder_decoder.get_config(arg)
  m = config.model
  m.window = 4
  m.global_tokens = (0,)
  m.bigbird_block = 4
  m.bigbird_random_blocks = 1
  m.linformer_k = 8
  m.linformer_length = 64
  m.performer_features = 32
  return config


def get_sweep():
  """One cell per variant, 3 seeds; eval translates test and test_long (greedy)."""
  cells = [{'model.attention': CAUSAL_ONLY[name], 'model.decoder_attention': name}
           if name in CAUSAL_ONLY else
           {'model.attention': name, **({'model.decoder_attention': NON_CAUSAL[name]}
                                        if name in NON_CAUSAL else {})}
           for name in VARIANTS]
  return {'cells': cells, 'seeds': [0, 1, 2], 'eval_flags': ['--translate=test_long']}
