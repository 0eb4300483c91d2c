"""The decoder-only model and schedule the synthetic task configs share (configs/mqar.py,
induction.py, selective_copy.py, memorize.py): 2 layers, D = 64, 4 heads, RoPE, batches of 64
rows, validation on the whole split. Not a config file of its own: each task's file names its
rows and knobs."""

from configs import default


def get_task_config(arg, task, *, max_length, steps, learning_rate=1e-3, quick=None, **knobs):
  """The config of `task` with rows of `max_length` tokens and `data.synthetic` `knobs`.

  Args:
    arg: the config file's argument (`quick` shrinks the rows and the knobs to `quick`).
    task: data.task.
    max_length: L.
    steps: training steps.
    learning_rate: the peak rate (AdamW, warmup 200 steps, cosine).
    quick: {'max_length': ..., knob: ...} of the smoke run (the default model's tiny size).
    **knobs: data.synthetic fields.
  """
  config = default.get_config(arg)
  config.data.task = task
  config.data.max_length = max_length
  config.data.synthetic.update(knobs)
  config.model.arch = 'decoder_only'
  config.model.position = 'rope'
  if 'quick' in default.parse_arg(arg):
    quick = dict(quick or {})
    config.data.max_length = quick.pop('max_length', 32)
    config.data.synthetic.update(quick)
    return config
  config.model.num_layers = 2
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.d_ff = 256
  config.train.batch_size = 64
  config.train.steps = steps
  config.train.learning_rate = learning_rate
  config.train.warmup_steps = 200
  config.train.eval_every = 500
  config.train.eval_batches = 0
  config.train.checkpoint_every = 1000
  config.train.log_every = 100
  return config
