"""Writes tests/fixtures/hf/: tiny random transformers models of each family, with their logits.

Run once where `transformers` and `torch` are installed (neither is a dependency of attnlab); a
script, it imports no attnlab module:

  python tools/hf/make_fixtures.py [--out=tests/fixtures/hf]

Each case is a folder as `save_pretrained` writes it (config.json, model.safetensors), built by the
family's own class from a small config (2 layers, d 64, GQA where the family has it), plus
expected.npz: `ids` [T], the float32 `logits` [T, V] and last hidden states [T, D] of one row,
and `greedy`: the prompt `ids[:P]` continued by `generate` (greedy, its KV cache, up to G new
tokens, ending at an eos).
versions.json records the transformers and torch versions. The weights are rounded to bfloat16
and saved so (half the bytes); the model computes in float32 on exactly those values. One case
carries a character-level BPE tokenizer.json (the `tokenizers` package), the others none.
"""

import argparse
import json
import os

import numpy as np

CASES = {  # name: (model_type, config fields beyond the shared ones)
    'llama': ('llama', {}),
    'llama_linear': ('llama', {'rope_scaling': {'rope_type': 'linear', 'factor': 2.0}}),
    'llama_dynamic': ('llama', {'rope_scaling': {'rope_type': 'dynamic', 'factor': 2.0}}),
    'llama_yarn': ('llama', {'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0,
                                              'original_max_position_embeddings': 16}}),
    'llama3': ('llama', {'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0,
                                          'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                          'original_max_position_embeddings': 16},
                         'tie_word_embeddings': True, 'rms_norm_eps': 1e-5}),
    'mistral': ('mistral', {'sliding_window': 8}),
    'qwen2': ('qwen2', {'tie_word_embeddings': True}),
    'qwen3': ('qwen3', {'head_dim': 32, 'tie_word_embeddings': True}),
    'gpt2': ('gpt2', {}),
}
VOCAB = 96
LENGTH = 24  # the row's tokens: past the sliding window (8) and dynamic NTK's context (16)
PROMPT, NEW_TOKENS = 10, 8
TOKENIZER_CASE = 'llama'


def _config(model_type, extra):
  """The family's config class from the shared small sizes and the case's fields."""
  import transformers
  if model_type == 'gpt2':
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2,
                                   n_head=4, bos_token_id=1, eos_token_id=2, **extra)
  cls = transformers.AutoConfig.for_model(model_type).__class__
  fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
  fields.update(extra)
  return cls(**fields)


def _tokenizer(out):
  """A character-level BPE of at most VOCAB ids (<pad> 0, <s> 1, </s> 2, <unk> 3; letters,
  digits and punctuation, so any English text and a digit pass key encode), saved into `out`."""
  import string
  import tokenizers
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token='<unk>'))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
  tok.decoder = tokenizers.decoders.Metaspace()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=['<pad>', '<s>', '</s>', '<unk>'], show_progress=False,
      initial_alphabet=list(string.ascii_letters + string.digits + '.,:;?!\'"-()'))
  text = ['the pass key is 71432. remember it. what is the pass key? the pass key is',
          'the grass is green and the sky is blue. here we go, there and back again.']
  tok.train_from_iterator(text * 4, trainer)
  tok.save(os.path.join(out, 'tokenizer.json'))
  with open(os.path.join(out, 'tokenizer_config.json'), 'w') as f:
    json.dump({'bos_token': '<s>', 'eos_token': '</s>', 'pad_token': '<pad>',
               'unk_token': '<unk>', 'tokenizer_class': 'PreTrainedTokenizerFast'}, f, indent=2)


def write_case(name, out_root, seed):
  """Builds, saves and runs case `name` into out_root/name."""
  import torch
  import transformers
  model_type, extra = CASES[name]
  torch.manual_seed(seed)
  config = _config(model_type, extra)
  model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.2)  # larger than the init's 0.02: the logits then depend on every weight
      p.copy_(p.to(torch.bfloat16).to(torch.float32))
  out = os.path.join(out_root, name)
  os.makedirs(out, exist_ok=True)
  model.to(torch.bfloat16).save_pretrained(out)  # bfloat16 on disk: the same values
  model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, VOCAB, size=LENGTH).astype(np.int64)
  with torch.no_grad():
    result = model(torch.from_numpy(ids)[None], output_hidden_states=True)
  # A fresh model: dynamic NTK keeps state between calls (its longest length so far).
  model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
  with torch.no_grad():
    greedy = model.generate(torch.from_numpy(ids[:PROMPT])[None], max_new_tokens=NEW_TOKENS,
                            do_sample=False, use_cache=True,
                            pad_token_id=0)
  np.savez(os.path.join(out, 'expected.npz'), ids=ids,
           logits=result.logits[0].float().numpy(),
           hidden=result.hidden_states[-1][0].float().numpy(), greedy=greedy[0].numpy(),
           prompt=np.int64(PROMPT))
  if name == TOKENIZER_CASE:
    _tokenizer(out)


def main():
  import tokenizers
  import torch
  import transformers
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join('tests', 'fixtures', 'hf'))
  parser.add_argument('--cases', default=','.join(CASES))
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  for name in args.cases.split(','):
    write_case(name, args.out, list(CASES).index(name))
    print(f'wrote {os.path.join(args.out, name)}')
  with open(os.path.join(args.out, 'versions.json'), 'w') as f:
    json.dump({'transformers': transformers.__version__, 'torch': torch.__version__,
               'tokenizers': tokenizers.__version__}, f, indent=2)


if __name__ == '__main__':
  main()
