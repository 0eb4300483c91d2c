"""The attention variants, keyed by `config.model.attention`.

Plain imports: the variant modules subclass `layers.attention.Attention`, so their registry lives
here, beside attention.py rather than inside it. Each class has `from_config(config.model, rngs=)`,
`check_config(config.model, config.data)` (layers.options.Configurable) and the capabilities
declared on `Attention` (has_scores, takes_score_terms, ...).
"""

from layers import attention
from layers import delta_attention
from layers import differential_attention
from layers import linear_attention
from layers import mla_attention
from layers import sparse_attention

VARIANTS = {
    'dense': attention.Attention,
    'sliding_window': sparse_attention.SlidingWindowAttention,
    'longformer': sparse_attention.LongformerAttention,
    'bigbird': sparse_attention.BigBirdAttention,
    'linformer': linear_attention.LinformerAttention,
    'performer': linear_attention.PerformerAttention,
    'linear': linear_attention.LinearAttention,
    'mla': mla_attention.MultiHeadLatentAttention,
    'gated_deltanet': delta_attention.GatedDeltaNetAttention,
    'differential': differential_attention.DifferentialAttention,
}
