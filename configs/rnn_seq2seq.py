"""RNN encoder-decoder baseline: LSTM/GRU with Bahdanau, Luong or no attention."""

from configs import default


def get_config(arg=None):
  """`arg` as in configs/default.py, plus `cell=lstm|gru` and `attention=bahdanau|luong|none`."""
  args = default.parse_arg(arg)
  config = default.get_config(arg)
  config.model.arch = 'rnn_seq2seq'
  config.model.rnn_cell = args.get('cell', 'lstm')
  config.model.rnn_attention = args.get('attention', 'bahdanau')
  config.model.rnn_luong_scale = True
  config.model.d_model = 128 if not args.get('quick') else 64  # hidden size of both RNNs
  if not args.get('quick'):
    config.train.steps = 2000
    config.train.learning_rate = 3e-3
    config.train.eval_every = 250
  config.data.max_length = 24
  config.data.packing = 'none'  # a recurrence reads one pair per row
  return config
