"""Passkey retrieval: a decoder-only Transformer finds a value hidden in toy-language filler.

Rows of L = 64 tokens, `<bos> filler <key> K V filler <query> K` -> V, the key at a uniform depth;
the loss is on V alone (data/passkey.py). eval.py reports the retrieval accuracy at 1, 2, 4 and
8 x L and depths 0-100% (eval.json `retrieval`, retrieval.png).

Train: python train.py --config=configs/passkey.py --workdir=DIR
Eval:  python eval.py --workdir=DIR [--lengths=1,2,4,8] [--rope_scaling=yarn:4]
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.data.task = 'passkey'
  config.data.max_length = 64
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  if 'quick' not in default.parse_arg(arg):
    config.model.num_layers = 2
    config.model.d_model = 64
    config.model.num_heads = 4
    config.model.d_ff = 256
    config.train.batch_size = 32
    config.train.steps = 3000
    config.train.warmup_steps = 100
    config.train.eval_every = 500
    config.train.checkpoint_every = 1000
    config.train.log_every = 50
  return config
