"""eval.py: greedy decoding equals a step-by-step argmax loop; eval.json and the plot are
written."""


import jax.numpy as jnp
from flax import nnx

from configs import decoder_only
from training import validation
from models import decoding
import models
from tests.helpers import jitted_forward



def test_greedy_translate_equals_python_argmax_loop():
  config = validation.resolve(decoder_only.get_config('quick'))
  model = models.build(config.model, 30, 16, rngs=nnx.Rngs(0))
  prompts = [[1, 7, 8, 3], [1, 9, 3], [1, 10, 11, 12, 13, 3]]
  got = decoding.greedy_translate(model, prompts, length=16, max_new=6, eos_id=2, batch_size=2)
  forward = jitted_forward(model)  # one compilation for every step of the loop
  for prompt, out in zip(prompts, got):
    seq = list(prompt)
    want = []
    for _ in range(6):
      logits = forward({'inputs': jnp.asarray([seq + [0] * (16 - len(seq))])})
      nxt = int(jnp.argmax(logits[0, len(seq) - 1]))
      if nxt == 2 or len(seq) >= 16:
        break
      want.append(nxt)
      seq.append(nxt)
    assert out == want


def test_a_randomized_positions_run_is_validated_at_fixed_sorted_random_ids(data_dir):
  """Validation (and eval.py's split losses) of a run with model.random_positions_max = N read its
  batches at sorted draws from [0, N), the same every time, not at 0..T-1."""
  import numpy as np
  from training import evaluation
  config = validation.resolve(decoder_only.get_config('quick'))
  config.data.data_dir = str(data_dir)
  config.data.packing = 'stream'
  seen = []

  def eval_fn(variables, batch):
    del variables
    seen.append(batch['positions'])
    return {'loss_sum': 0.0, 'correct_sum': 0.0, 'weight_sum': 1.0}

  evaluation.evaluate_sums(eval_fn, None, config, 'validation', 2)
  plain = list(seen)
  assert all((p == np.arange(p.shape[1])).all() for p in plain)  # no randomization: 0..T-1
  config.model.random_positions_max = 8 * config.data.max_length
  seen.clear()
  evaluation.evaluate_sums(eval_fn, None, config, 'validation', 2)
  first = list(seen)
  seen.clear()
  evaluation.evaluate_sums(eval_fn, None, config, 'validation', 2)
  for a, b in zip(first, seen):
    np.testing.assert_array_equal(a, b)  # a fixed key: the same ids every evaluation
    assert (np.diff(a, axis=1) > 0).all() and a.max() < config.model.random_positions_max
  assert not np.array_equal(first[0], first[1])  # a draw per batch
  assert first[0].max() >= config.data.max_length  # beyond the training length, as in training
