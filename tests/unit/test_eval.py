"""eval.py: greedy decoding equals a step-by-step argmax loop; eval.json and the plot are written."""


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
