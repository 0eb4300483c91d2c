"""Checks a resolved config before anything compiles; each problem is one line naming the field.

The layers' registries own their options: for each of them this module checks the key, then asks
the entries (layers.options.Configurable: `check_options` of every entry, `check_config` of the
chosen one) and cross-checks the chosen attention variant's declared capabilities. What is left
here is the fields no layer owns: sizes, the architectures', train.*, data.*, mesh and scan.
"""

import math

import models
from layers import attention
from layers import attention_variants
from layers import block
from layers import feed_forward
from layers import initializers
from layers import moe
from layers import norms
from layers import options
from layers.options import ConfigError
from layers import positions
from layers import rnn_attention
from layers import sharding
from models import rnn_seq2seq
from models import stack
from data import pipeline
from data import text_corpus
from training import state as state_lib
from training import validation_attention
from training import validation_passkey
from training import validation_positions
from training import validation_synthetic
from training import validation_tokenizer

# The valid values live where they are used; validation only names them.
SCHEDULES = state_lib.SCHEDULES
LOSS_ON = pipeline.LOSS_ON
PACKINGS = tuple(pipeline.PACKINGS)

# The registries whose entries read `config.model` fields (layers.options.Configurable).
REGISTRIES = (attention_variants.VARIANTS, positions.POSITIONS, norms.NORMS, feed_forward.FFNS,
              rnn_attention.RNN_ATTENTIONS)

_choice = options.choice
_positive = options.positive


def _check_registry(name, registry, model_cfg, data_cfg):
  """The entries' own checks for `model.<name>` (its key already checked by `_choice`): every
  entry's `check_options`, then the chosen entry's `check_config`."""
  for entry in registry.values():
    entry.check_options(model_cfg)
  registry[model_cfg[name]].check_config(model_cfg, data_cfg)


def resolve(config):
  """Fills the derived defaults in place: num_kv_heads 0 -> num_heads, d_ff 0 -> 4·d_model, then
  each registry entry's own (`resolve_options`, e.g. Linformer's length)."""
  m = config.model
  if m.num_kv_heads == 0:
    m.num_kv_heads = m.num_heads
  if m.d_ff == 0:
    m.d_ff = 4 * m.d_model
  for registry in REGISTRIES:
    for entry in registry.values():
      entry.resolve_options(m, config.data)
  return config


def validate(config):
  """Raises ConfigError on the first invalid field of `config` (after `resolve`)."""
  _validate_model(config)
  _validate_train(config)
  _validate_data(config)
  _validate_mesh(config)
  validation_attention.check_kernel(config)


def validate_model(config):
  """The model's part of `validate`: config.model, the mesh and the kernel (a checkpoint converter
  checks a model whose data is not chosen yet)."""
  _validate_model(config)
  _validate_mesh(config)
  validation_attention.check_kernel(config)


def _validate_model(config):
  """config.model: the registries' keys and checks, the sizes and the architectures' fields."""
  m, d = config.model, config.data
  _choice('model.arch', m.arch, models.ARCHS)
  _choice('model.attention', m.attention, attention_variants.VARIANTS)
  _validate_layer_pattern(config)
  _choice('model.attention_impl', m.attention_impl, attention.KERNELS)
  _choice('model.position', m.position, positions.POSITIONS)
  _choice('model.norm', m.norm, norms.NORMS)
  _choice('model.norm_position', m.norm_position, block.NORM_POSITIONS)
  scales = m.get('deepnorm_scales', 'alpha_beta')  # a config.json from before the field
  _choice('model.deepnorm_scales', scales, block.DEEPNORM_SCALES)
  if scales != 'alpha_beta' and m.norm_position != 'deepnorm':
    raise ConfigError(f'model.deepnorm_scales={scales!r} ablates DeepNorm, which '
                      f"model.norm_position={m.norm_position!r} does not use; valid here: "
                      "'alpha_beta' (or model.norm_position='deepnorm')")
  _choice('model.ffn', m.ffn, feed_forward.FFNS)
  for name in ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'd_ff'):
    value = m[name]
    if not isinstance(value, int) or value <= 0:
      raise ConfigError(f'model.{name}={value!r} must be a positive integer')
  if m.d_model % m.num_heads:
    divisors = [n for n in range(1, m.d_model + 1) if m.d_model % n == 0]
    raise ConfigError(f'model.num_heads={m.num_heads} must divide model.d_model={m.d_model}; '
                      f'valid values: {", ".join(map(str, divisors))}')
  if m.num_heads % m.num_kv_heads:
    divisors = [k for k in range(1, m.num_heads + 1) if m.num_heads % k == 0]
    raise ConfigError(f'model.num_kv_heads={m.num_kv_heads} must divide model.num_heads='
                      f'{m.num_heads}; valid values: {", ".join(map(str, divisors))}')
  _check_registry('position', positions.POSITIONS, m, d)
  validation_positions.check_config(config)
  _validate_init_from(config)
  _check_registry('norm', norms.NORMS, m, d)
  _check_registry('ffn', feed_forward.FFNS, m, d)
  moe.MoE.check_options(m)  # the MoE layer's fields, whichever FFN kind (layers.moe)
  moe.MoE.check_config(m, d, causal=models.spec(m.arch).causal)
  if not isinstance(m.share_embeddings, bool):
    raise ConfigError(f'model.share_embeddings={m.share_embeddings!r} must be True or False')
  for name in ('mlm_rate', 'mlm_mask_prob', 'mlm_random_prob', 'mlm_target_rate'):
    if not isinstance(m[name], (int, float)) or not 0.0 <= m[name] <= 1.0:
      raise ConfigError(f'model.{name}={m[name]!r} must be in [0, 1]')
  spec = models.spec(m.arch)  # what the architecture declares (models.contract.ArchSpec)
  if 'mlm_rate' in spec.options and m.mlm_rate == 0 and m.mlm_target_rate == 0:
    raise ConfigError('model.mlm_rate=0 with model.mlm_target_rate=0 masks nothing to predict')
  if m.mlm_mask_prob + m.mlm_random_prob > 1.0:
    raise ConfigError(f'model.mlm_random_prob={m.mlm_random_prob!r} plus model.mlm_mask_prob='
                      f'{m.mlm_mask_prob!r} must be at most 1')
  _choice('model.rnn_cell', m.rnn_cell, rnn_seq2seq.CELLS)
  _choice('model.rnn_attention', m.rnn_attention, rnn_attention.RNN_ATTENTIONS)
  _check_registry('rnn_attention', rnn_attention.RNN_ATTENTIONS, m, d)
  if config.data.packing in PACKINGS and config.data.packing not in spec.packings:
    raise ConfigError(f"data.packing={config.data.packing!r} is not valid for model.arch="
                      f"{m.arch!r}{spec.packing_note}; valid values: {', '.join(spec.packings)}")
  _validate_attention(config)
  _validate_scan(config)
  _validate_model_options(config)
  if not 0.0 <= m.dropout < 1.0:
    raise ConfigError(f'model.dropout={m.dropout!r} must be in [0, 1)')


def _validate_train(config):
  """config.train: the loop's and the optimiser's fields."""
  t = config.train
  for name in ('steps', 'batch_size', 'checkpoint_every', 'eval_every', 'log_every',
               'keep_checkpoints'):
    if not isinstance(t[name], int) or t[name] <= 0:
      raise ConfigError(f'train.{name}={t[name]!r} must be a positive integer')
  _positive('train.learning_rate', t.learning_rate)
  _positive('train.weight_decay', t.weight_decay, zero_ok=True)
  _positive('train.grad_clip_norm', t.grad_clip_norm, zero_ok=True)
  _positive('train.eval_batches', t.eval_batches, zero_ok=True)
  if not isinstance(t.warmup_steps, int) or not 0 <= t.warmup_steps < t.steps:
    raise ConfigError(f'train.warmup_steps={t.warmup_steps!r} must be an integer in '
                      f'[0, train.steps={t.steps})')
  for name in ('b1', 'b2'):
    if not 0.0 <= t[name] < 1.0:
      raise ConfigError(f'train.{name}={t[name]!r} must be in [0, 1)')
  if not isinstance(t.diagnostics, bool):
    raise ConfigError(f'train.diagnostics={t.diagnostics!r} must be True or False')
  if not isinstance(t.diagnostics_batch, int) or isinstance(t.diagnostics_batch, bool) or (
      t.diagnostics_batch < 0):
    raise ConfigError(f'train.diagnostics_batch={t.diagnostics_batch!r} must be an integer >= 0 '
                      '(0 = the whole batch)')
  if not isinstance(t.skip_nonfinite, bool):
    raise ConfigError(f'train.skip_nonfinite={t.skip_nonfinite!r} must be True or False')
  _choice('train.schedule', t.schedule, SCHEDULES)
  if not isinstance(t.seed, int) or isinstance(t.seed, bool) or not 0 <= t.seed < 2 ** 32:
    raise ConfigError(f'train.seed={t.seed!r} must be an integer in [0, 2**32)')
  accum = t.get('grad_accum_steps', 1)
  if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1 or t.batch_size % accum:
    raise ConfigError(f'train.grad_accum_steps={accum!r} must be a positive integer dividing '
                      f'train.batch_size={t.batch_size}')
  # No float16: its gradients underflow without loss scaling, which the step does not do.
  _choice('train.compute_dtype', t.get('compute_dtype', 'float32'), state_lib.COMPUTE_DTYPES)
  _choice('train.loss_on', t.loss_on, LOSS_ON)
  _validate_loop_options(config)


def _validate_data(config):
  """config.data: packing, the dataset's directory, shards, length and the task's own fields."""
  t, d = config.train, config.data
  _choice('data.packing', d.packing, PACKINGS)
  if not isinstance(d.data_dir, str) or not d.data_dir.strip():
    raise ConfigError(f'data.data_dir={d.data_dir!r} must name a directory (an empty path would '
                      "put the dataset in the current directory); e.g. './tfds_data'")
  shards = d.get('shards', 1)
  if (not isinstance(shards, int) or isinstance(shards, bool) or shards < 1
      or t.batch_size % shards):
    raise ConfigError(f'data.shards={shards!r} must be a positive integer dividing '
                      f'train.batch_size={t.batch_size} '
                      '(each shard gives batch_size / shards rows)')
  if not isinstance(d.max_length, int) or d.max_length < 8:
    raise ConfigError(f'data.max_length={d.max_length!r} must be an integer >= 8')
  _choice('data.task', d.task, pipeline.TASKS)
  validation_tokenizer.check_config(config)  # before the tasks' checks, which may read it
  validation_passkey.check_config(config)  # its fields, or that no other task sets them
  validation_synthetic.check_config(config)  # the same for the synthetic tasks' knobs
  _validate_code_data(config)
  if d.task in text_corpus.TASKS:
    _validate_text_data(config)
  else:
    given = sorted(k for k, v in (d.get('files', None) or {}).items() if v)
    if given and not validation_tokenizer.reads_files(d):
      raise ConfigError(f'data.files.{given[0]}={d.files[given[0]]!r} is read only by '
                        f"data.task='text_pairs' or 'text_lm' (data.task={d.task!r} brings its "
                        "own data); valid here: '' (or set data.task)")


def _validate_code_data(config):
  """data.task=python_code: the stdlib corpus (data/python_code.py), a text_lm corpus of its own;
  data.code_max_files is read by it alone."""
  d, m = config.data, config.model
  max_files = d.get('code_max_files', 0)
  if d.task != 'python_code':
    if max_files != 0:
      raise ConfigError(f"data.code_max_files={max_files!r} is read only by data.task="
                        f"'python_code' (data.task={d.task!r}); valid here: 0")
    return
  if not isinstance(max_files, int) or isinstance(max_files, bool) or max_files < 0:
    raise ConfigError(f'data.code_max_files={max_files!r} must be an integer >= 0 (files per '
                      'split; 0 = every file)')
  vocab = d.get('vocab_size', None)
  if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 6:
    raise ConfigError(f'data.vocab_size={vocab!r} must be an integer > 6 (the SentencePiece '
                      'pieces, the 6 special tokens included), e.g. 1000')
  if not models.spec(m.arch).documents:
    raise ConfigError(f"data.task='python_code' (documents, no sentence pairs) is not valid for "
                      f'model.arch={m.arch!r}; valid archs: '
                      f'{", ".join(models.archs_where(lambda s: s.documents))}')


def _validate_text_data(config):
  """data.files, data.vocab_size and data.shared_vocab of your own corpus (text_pairs, text_lm);
  the files' contents are checked where they are read (`data.text_corpus`, one line naming the
  file and line)."""
  d, m = config.data, config.model
  files = d.get('files', None)
  for split in text_corpus.SPLITS:
    path = files.get(split, '') if files is not None else ''
    if not isinstance(path, str) or not path.strip():
      lines = 'source<TAB>target lines' if d.task == 'text_pairs' else 'one document per line'
      raise ConfigError(f'data.files.{split}={path!r} must name a file of {lines} for '
                        f'data.task={d.task!r} (a local path or gs://)')
  vocab = d.get('vocab_size', None)
  if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 6:
    raise ConfigError(f'data.vocab_size={vocab!r} must be an integer > 6 (the SentencePiece '
                      'pieces, the 6 special tokens included), e.g. 1000')
  if not isinstance(d.get('shared_vocab', True), bool):
    raise ConfigError(f'data.shared_vocab={d.shared_vocab!r} must be True or False')
  spec = models.spec(m.arch)
  if d.task == 'text_lm' and not spec.documents:
    raise ConfigError(f"data.task='text_lm' (documents, no sentence pairs) is not valid for "
                      f'model.arch={m.arch!r}; valid archs: '
                      f'{", ".join(models.archs_where(lambda s: s.documents))}')
  if d.task == 'text_lm' and 'mlm_target_rate' in spec.options and m.mlm_target_rate > 0:
    raise ConfigError(f"model.mlm_target_rate={m.mlm_target_rate!r} masks a target side, which "
                      "data.task='text_lm' documents lack; valid: 0")


def _validate_mesh(config):
  """config.mesh: positive axis sizes, known names in the rules, a batch the data axes divide.
  (That the sizes' product is the device count is checked where the devices are known: train.py.)"""
  mesh = config.get('mesh', None)
  if mesh is None:
    return
  for axis in sharding.MESH_AXES:
    value = mesh.get(axis, 1)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ConfigError(f'mesh.{axis}={value!r} must be a positive integer')
  for rule in mesh.get('rules', ()) or ():
    if len(rule) != 2 or rule[0] not in sharding.LOGICAL_AXES:
      raise ConfigError(f'mesh.rules entry {rule!r} must be (logical name, mesh axes) with a '
                        f'logical name in: {", ".join(sharding.LOGICAL_AXES)}')
    axes = rule[1] if isinstance(rule[1], (list, tuple)) else (rule[1],)
    bad = [a for a in axes if a is not None and a not in sharding.MESH_AXES]
    if bad:
      raise ConfigError(f'mesh.rules entry {rule!r}: {bad[0]!r} is not a mesh axis; valid: '
                        f'{", ".join(sharding.MESH_AXES)}')
  experts = config.model.get('moe_experts', 0)
  if experts and experts % mesh.get('expert', 1):
    divisors = [n for n in range(1, experts + 1) if experts % n == 0]
    raise ConfigError(f'mesh.expert={mesh.get("expert", 1)} must divide model.moe_experts='
                      f'{experts}; valid values: {", ".join(map(str, divisors))}')
  rows = mesh.get('data', 1) * mesh.get('fsdp', 1) * mesh.get('expert', 1)
  accum = config.train.get('grad_accum_steps', 1)
  if config.train.batch_size % (rows * accum):
    raise ConfigError(f'train.batch_size={config.train.batch_size} must be a multiple of '
                      f'mesh.data x mesh.fsdp x mesh.expert x train.grad_accum_steps = '
                      f'{rows * accum} (each data-parallel shard gets whole rows of every '
                      'micro-batch)')


def _validate_scan(config):
  """model.scan_layers and model.remat (models/stack.py)."""
  m = config.model
  scan, remat = m.get('scan_layers', False), m.get('remat', 'none')
  if not isinstance(scan, bool):
    raise ConfigError(f'model.scan_layers={scan!r} must be True or False')
  _choice('model.remat', remat, stack.REMAT_POLICIES)
  if remat != 'none' and not scan:
    raise ConfigError(f'model.remat={remat!r} needs model.scan_layers=True (it is applied to the '
                      "scanned block); valid values without it: none")
  if not scan:
    return
  if not models.spec(m.arch).stacks:
    raise ConfigError(f'model.scan_layers=True is not valid for model.arch={m.arch!r} (no '
                      'Transformer blocks); valid archs: '
                      f'{", ".join(models.archs_where(lambda s: s.stacks))}')
  names = stack.layer_attentions(m)
  if len(set(names)) > 1:
    raise ConfigError(f'model.scan_layers=True is not valid for model.layer_pattern='
                      f'{m.layer_pattern!r} (layers of different variants cannot share one '
                      'scanned trace); use scan_layers=False, or a pattern of one variant')
  if not attention_variants.VARIANTS[names[0]].scannable:
    raise ConfigError(f'model.scan_layers=True is not valid for '
                      f'{validation_attention.variant_label(m, names[0], "encoder")} '
                      '(each layer is built on its own: random blocks/features from '
                      'model.attention_seed, or constants of its depth, and scanned layers share '
                      'one trace); use '
                      'scan_layers=False')


def _validate_init_from(config):
  """`train.init_from`: a workdir path or ''; whether it holds a fitting checkpoint is checked when
  the run starts (training.state.init_from), since a sweep's source cell may not have run yet."""
  source = config.train.get('init_from', '')
  if not isinstance(source, str):
    raise ConfigError(f'train.init_from={source!r} must be a workdir path (or empty: no source)')


def _validate_model_options(config):
  """The embedding and output options (models/stack.py) and the projection initialiser."""
  m = config.model
  _choice('model.kernel_init', m.get('kernel_init', 'lecun_normal'), initializers.KERNEL_INITS)
  _choice('model.embed_scale', m.get('embed_scale', 'sqrt_d'), stack.EMBED_SCALES)
  options.boolean('model.tie_output', m.get('tie_output', True))
  options.boolean('model.output_bias', m.get('output_bias', True))
  size = m.get('vocab_size', 0)  # against the tokenizer's in training.state.model_vocab_size
  if not isinstance(size, int) or isinstance(size, bool) or size < 0:
    raise ConfigError(f'model.vocab_size={size!r} must be an integer >= 0 (0 = the tokenizer\'s)')
  _off_or_nonnegative('model.final_logit_softcap', m.get('final_logit_softcap', 0.0))
  if not m.get('tie_output', True) and config.train.get('loss_chunk', 0):
    raise ConfigError('train.loss_chunk > 0 needs model.tie_output=True (the tiled loss reads '
                      'the output as a table without a bias); valid with tie_output=False: 0')


def _validate_layer_pattern(config):
  """`model.layer_pattern`: a comma-separated string of attention variants (or '')."""
  m = config.model
  pattern = m.get('layer_pattern', '')
  if not isinstance(pattern, str):
    raise ConfigError(f'model.layer_pattern={pattern!r} must be a comma-separated string of '
                      f'attention variants (or \'\'); valid entries: '
                      f'{", ".join(sorted(attention_variants.VARIANTS))}')
  if not pattern:
    return
  for entry in stack.pattern_entries(m):
    if entry not in attention_variants.VARIANTS:
      raise ConfigError(f'model.layer_pattern={pattern!r}: entry {entry!r} is not valid; valid '
                        f'entries: {", ".join(sorted(attention_variants.VARIANTS))}')
  if not models.spec(m.arch).stacks:
    raise ConfigError(f'model.layer_pattern={pattern!r} is not valid for model.arch={m.arch!r} '
                      "(no Transformer blocks); valid value here: ''")
  if m.get('decoder_attention', ''):
    raise ConfigError(f'model.layer_pattern={pattern!r} sets every stack\'s layers, so '
                      f'model.decoder_attention={m.decoder_attention!r} would be ignored; valid '
                      "value with a pattern: ''")


def _validate_attention(config):
  """`model.attention`, or each entry of `model.layer_pattern` checked as if it were
  `model.attention` (its message then names the pattern and the entry)."""
  m = config.model
  pattern = m.get('layer_pattern', '')
  if not pattern:
    _validate_variant(config)
    return
  for entry in dict.fromkeys(stack.pattern_entries(m)):
    entry_config = config.copy_and_resolve_references()
    entry_config.model.update(attention=entry, layer_pattern='')
    try:
      _validate_variant(entry_config)
    except ConfigError as e:
      raise ConfigError(f'model.layer_pattern={pattern!r}, entry {entry!r}: {e}') from None


def _validate_variant(config):
  """`model.attention`: the variant's own checks, then its declared capabilities against the
  architecture and the packing."""
  m = config.model
  _check_registry('attention', attention_variants.VARIANTS, m, config.data)
  variant = attention_variants.VARIANTS[m.attention]
  spec = models.spec(m.arch)
  decoder = m.get('decoder_attention', '')
  if decoder:
    if 'decoder_attention' not in spec.options:
      readers = ' or '.join(repr(a) for a in models.archs_where(
          lambda s: 'decoder_attention' in s.options))
      raise ConfigError(f'model.decoder_attention={decoder!r} is read only by '
                        f'model.arch={readers} (model.arch={m.arch!r}); valid value '
                        "here: '' (model.attention is used)")
    _choice('model.decoder_attention', decoder, attention_variants.VARIANTS)
    decoder_cfg = m.copy_and_resolve_references()
    decoder_cfg.attention = decoder
    _check_registry('attention', attention_variants.VARIANTS, decoder_cfg, config.data)
    causal = [name for name, v in attention_variants.VARIANTS.items() if v.supports_causal]
    if not attention_variants.VARIANTS[decoder].supports_causal:
      raise ConfigError(f'model.decoder_attention={decoder!r} is not causal; valid values: '
                        f"'', {', '.join(causal)}")
    if m.scan_layers and not attention_variants.VARIANTS[decoder].scannable:
      raise ConfigError(f'model.scan_layers=True is not valid for model.decoder_attention='
                        f'{decoder!r} (its layers draw their own random blocks/features); use '
                        'scan_layers=False')
  elif not variant.supports_causal and spec.causal:
    hint = (" or set model.decoder_attention to a causal variant (the encoder keeps "
            f"{m.attention!r})" if 'decoder_attention' in spec.options else '')
    bidirectional_archs = models.archs_where(lambda s: s.stacks and not s.causal)
    raise ConfigError(f'model.attention={m.attention!r} is not causal and model.arch={m.arch!r} '
                      'needs causal self-attention; valid archs: '
                      f'{", ".join(bidirectional_archs)}{hint}')
  encoders = [s.role for s in spec.stacks if not s.causal]
  for name in dict.fromkeys(n for role, names in models.layer_attentions(m).items()
                            if role in encoders for n in names):
    # An encoder stack's self-attention sees the whole row: a causal-only variant cannot run there.
    if not attention_variants.VARIANTS[name].supports_bidirectional:
      bidirectional = [n for n, v in attention_variants.VARIANTS.items()
                       if v.supports_bidirectional]
      raise ConfigError(f'{validation_attention.variant_label(m, name, "encoder")} is causal only, '
                        f'and the encoder of model.arch={m.arch!r} would run it bidirectionally; '
                        f'valid values there: {", ".join(bidirectional)}')
  if not variant.supports_segments and config.data.packing == 'segments':
    raise ConfigError(f"data.packing='segments' is not valid for model.attention={m.attention!r} "
                      '(it hides padding only, not other segments); valid values: '
                      f'{", ".join(p for p in PACKINGS if p != "segments")}')


def check_writable(name, path):
  """Raises ConfigError unless `path` is (or can be created as) a writable directory."""
  import os
  if '://' in str(path):
    return  # object storage (gs://): no local check applies; the run's first write is the test
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'{name}={path!r} is a file; it must be a directory (or not exist yet)')
  parent = os.path.abspath(path)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f'{name}={path!r} cannot be created: {parent!r} is a file')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f'{name}={path!r} cannot be written (no write permission on {parent!r})')


def _off_or_nonnegative(name, value):
  """Raises ConfigError unless `value` is a finite number >= 0 (a coefficient whose 0 is off)."""
  if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
      or value < 0):
    raise ConfigError(f'{name}={value!r} must be a finite number >= 0 (0 = off)')


def _validate_loop_options(config):
  """train.loss_chunk (the vocabulary-tiled loss), train.z_loss (PaLM's z-loss coefficient) and
  train.profile_steps (a profiler trace)."""
  t = config.train
  _off_or_nonnegative('train.z_loss', t.get('z_loss', 0.0))
  chunk = t.get('loss_chunk', 0)
  if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
    raise ConfigError(f'train.loss_chunk={chunk!r} must be an integer >= 0 (0 = off, C = '
                      'vocabulary rows per tile)')
  if chunk and not models.spec(config.model.arch).tiled_loss:
    raise ConfigError(f'train.loss_chunk > 0 is not valid for model.arch={config.model.arch!r} '
                      '(its output layer is not a tied embedding); valid archs: '
                      f'{", ".join(models.archs_where(lambda s: s.tiled_loss))}')
  spec = t.get('profile_steps', '')
  if spec:
    parts = str(spec).split(',')
    ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts)
    if not ok or not 1 <= int(parts[0]) <= int(parts[1]) <= t.steps:
      raise ConfigError(f'train.profile_steps={spec!r} must be START,END with 1 <= START <= END <= '
                        f'train.steps={t.steps} (empty = no trace)')
