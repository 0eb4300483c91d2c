"""Multi-query associative recall (Zoology): a decoder-only Transformer looks up the values of keys
it saw earlier in the row.

Rows of L = 128 tokens: 16 key-value pairs, then the 16 keys asked again at random places of a
noise region, each followed by its value; the loss and accuracy are on the asked values alone
(data/synthetic.py). Dense attention solves it at this width; a fixed-size state (attention=linear)
must hold all 16 pairs at once and falls short. eval.py reports the recall accuracy
(`accuracy.test`), and by number of pairs and key-query distance (eval.json `recall`).

Train: python train.py --config=configs/mqar.py --workdir=DIR [--config.model.attention=linear]
Eval:  python eval.py --workdir=DIR
"""

from configs import default


def get_config(arg=None):
  config = default.get_config(arg)
  config.data.task = 'mqar'
  config.data.max_length = 128
  config.data.synthetic.pairs = 16
  config.data.synthetic.keys = 64
  config.data.synthetic.values = 64
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  if 'quick' in default.parse_arg(arg):
    config.data.max_length = 32
    config.data.synthetic.pairs = 4
    return config
  config.model.num_layers = 2
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.train.batch_size = 64
  config.train.steps = 2000
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 200
  config.train.eval_every = 500
  config.train.eval_batches = 0
  config.train.checkpoint_every = 1000
  config.train.log_every = 100
  return config
