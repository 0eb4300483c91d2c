"""Bad inputs caught before anything compiles, checked in-process: non-finite and empty config
values, config files that cannot load, overrides of missing fields, eval.py's flags, sweeps' seeds
and files, and a cell interrupted by a signal (the memory estimate: test_bad_memory.py; the
command lines themselves: tests/integration/test_cli_reliability.py)."""

import os
import signal
import threading

from absl import flags
import jax
import pytest

from configs import decoder_only
from configs import default
from tests.helpers import ROOT
from layers import attention
from layers import options
from tools.sweep import processes
from tools.sweep import runner as sweep_runner
from tools.sweep import spec as sweep_spec
from training import cli_checks
from training import config_file
from training import eval_checks
from training import train_checks
from training import validation



# --- Config files ------------------------------------------------------------------------------

BAD_FILES = [
    ('syntax.py', 'def get_config(\n',
     "syntax error in .*syntax.py line 1: '\\(' was never closed"),
    ('raises.py', 'def get_config(arg=None):\n  raise RuntimeError("boom")\n',
     r'get_config\(\) raised RuntimeError: boom'),
    ('a_dict.py', 'def get_config(arg=None):\n  return {"model": {}}\n',
     'returned dict, not an ml_collections.ConfigDict'),
    ('no_fn.py', 'X = 1\n', 'defines no get_config'),
    ('import_fails.py', 'import no_such_module_anywhere\n',
     'importing .* raised ModuleNotFoundError'),
    ('no_train.py', 'import ml_collections\n\ndef get_config(arg=None):\n'
     '  return ml_collections.ConfigDict({"model": {}, "data": {}})\n', 'has no train section'),
]


@pytest.mark.parametrize('name,text,message', BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_a_config_file_that_cannot_load_is_one_line(tmp_path, name, text, message):
  path = tmp_path / name
  path.write_text(text)
  with pytest.raises(options.ConfigError, match=message) as e:
    config_file.load_config_file(str(path))
  assert '\n' not in str(e.value) and str(e.value).startswith(f'--config={path}')


def test_a_missing_config_file_lists_the_config_files(tmp_path):
  with pytest.raises(options.ConfigError, match='no such file') as e:
    config_file.load_config_file(str(tmp_path / 'nope.py:quick'))
  assert 'configs/decoder_only.py' in str(e.value) and 'configs/__init__.py' not in str(e.value)
  with pytest.raises(options.ConfigError, match='--config= is empty'):
    config_file.load_config_file('')


def test_config_arguments_are_checked_and_parse_arg_is_restored():
  path = os.path.join(ROOT, 'configs', 'decoder_only.py')
  parse_arg = default.parse_arg
  with pytest.raises(options.ConfigError, match="size='huge' is not valid; valid values: base, "
                     'large, small, tiny, xl'):
    config_file.load_config_file(f'{path}:size=huge')
  with pytest.raises(options.ConfigError,
                     match="argument 'bogus' is not one .* reads; valid: quick, size"):
    config_file.load_config_file(f'{path}:quick,bogus=1')
  assert default.parse_arg is parse_arg
  config = config_file.load_config_file(f'{path}:quick,size=tiny')
  assert config.train.steps == 20 and config.model.d_model == 64
  # A file with arguments of its own (rnn_seq2seq: cell, attention) reads them too.
  rnn = config_file.load_config_file(
      os.path.join(ROOT, 'configs', 'rnn_seq2seq.py:attention=luong'))
  assert rnn.model.rnn_attention == 'luong'
  with pytest.raises(options.ConfigError, match='valid: attention, cell, quick, size'):
    config_file.load_config_file(os.path.join(ROOT, 'configs', 'rnn_seq2seq.py:atention=luong'))
  assert default.parse_arg is parse_arg


def test_a_file_that_parses_its_argument_itself_is_not_second_guessed(tmp_path):
  path = tmp_path / 'own.py'
  path.write_text('from configs import default\n\ndef get_config(arg=None):\n'
                  '  config = default.get_config()\n  config.train.steps = int(arg)\n'
                  '  return config\n')
  assert config_file.load_config_file(f'{path}:7').train.steps == 7


def test_an_override_of_a_missing_field_names_the_valid_ones():
  config = decoder_only.get_config()
  cli_checks.check_field(config, 'model.d_model', '--config.model.d_model=8')
  with pytest.raises(options.ConfigError, match="model has no field 'foo'; valid fields of "
                     'model: arch, attention,') as e:
    cli_checks.check_field(config, 'model.foo', '--config.model.foo=1')
  assert str(e.value).startswith('--config.model.foo=1: ')
  with pytest.raises(options.ConfigError, match=r"'modle' \(did you mean model\?\)"):
    cli_checks.check_field(config, 'modle.d_model', '--config.modle.d_model=1')
  with pytest.raises(options.ConfigError, match="model.d_model has no field 'x'"):
    cli_checks.check_field(config, 'model.d_model.x', '--config.model.d_model.x=1')


def test_absl_value_errors_become_one_line_naming_the_type():
  config = decoder_only.get_config()
  for text, expected in (
      ('abc', "model.d_model='abc' is not valid (invalid literal for int() with base 10: 'abc'); "
              'valid: an integer, e.g. 128'),
      ('1e9', "model.d_model='1e9' is not valid (invalid literal for int() with base 10: '1e9'); "
              'valid: an integer, e.g. 128')):
    error = flags.IllegalFlagValueError(
        f"flag --config.model.d_model={text}: invalid literal for int() with base 10: '{text}'")
    assert cli_checks._value_error_line(error, config) == expected
  error = flags.IllegalFlagValueError("flag --config.train.steps=1.5: invalid literal for int() "
                                      "with base 10: '1.5'")
  assert cli_checks._value_error_line(error, config).endswith('valid: an integer, e.g. 1200')


def test_an_empty_workdir_is_refused():
  with pytest.raises(options.ConfigError, match='--workdir is empty'):
    cli_checks.check_workdir('')
  with pytest.raises(options.ConfigError, match='--workdir is required'):
    cli_checks.check_workdir(None)


def test_a_mesh_that_does_not_cover_the_devices_is_a_config_error(tmp_path):
  config = decoder_only.get_config('quick')
  config.data.data_dir = str(tmp_path / 'd')
  config.mesh.data = 3  # batch 8 is not a multiple of 3: validation refuses it
  with pytest.raises(options.ConfigError, match='train.batch_size=8'):
    train_checks.check_train_run(config, str(tmp_path / 'w'))
  config.mesh.data = 2  # the batch divides, but 2 is not the device count (8 here)
  with pytest.raises(options.ConfigError, match=f'product 2 must equal the device count '
                     f'{jax.device_count()}'):
    train_checks.check_train_run(config, str(tmp_path / 'w'))


# --- Config values -----------------------------------------------------------------------------

# Coefficients whose 0 is off (models/stack.py, training/steps.py): a finite number >= 0.
BAD_VALUES = [
    ('model.final_logit_softcap', -1.0, r'model.final_logit_softcap=-1.0 must be a finite number '
                                        r'>= 0 \(0 = off\)$'),
    ('model.final_logit_softcap', float('nan'), 'model.final_logit_softcap=nan must be'),
    ('model.final_logit_softcap', float('inf'), 'model.final_logit_softcap=inf must be'),
    ('model.final_logit_softcap', None, 'model.final_logit_softcap=None must be'),
    ('train.z_loss', -1e-4, r'train.z_loss=-0.0001 must be a finite number >= 0 \(0 = off\)$'),
    ('train.z_loss', float('nan'), 'train.z_loss=nan must be'),
    ('train.z_loss', float('inf'), 'train.z_loss=inf must be'),
    ('train.z_loss', None, 'train.z_loss=None must be'),
    # MLA's latent width (layers/mla_attention.py), refused whichever variant is chosen.
    ('model.mla_kv_rank', 0, r'model.mla_kv_rank=0 must be a positive integer$'),
    ('model.mla_kv_rank', -8, r'model.mla_kv_rank=-8 must be a positive integer$'),
    ('model.mla_rope_dim', 3, r'model.mla_rope_dim=3 must be even \(RoPE rotates pairs\)'),
    # A hybrid stack's pattern (models/stack.py): known variants separated by commas.
    ('model.layer_pattern', 'dense,nope', r"model.layer_pattern='dense,nope': entry 'nope' is not "
                                          'valid; valid entries: bigbird, dense, '),
    ('model.layer_pattern', 'dense,', "model.layer_pattern='dense,': entry '' is not valid"),
    ('model.layer_pattern', None, 'model.layer_pattern=None must be a comma-separated string'),
    ('model.attn_logit_softcap', -1.0, r'model.attn_logit_softcap=-1.0 must be a finite number '
                                       r'>= 0 \(0 = off\)$'),
    ('model.attn_logit_softcap', float('nan'), 'model.attn_logit_softcap=nan must be'),
    ('model.attn_logit_softcap', None, 'model.attn_logit_softcap=None must be'),
    ('model.attention_sinks', None, 'model.attention_sinks=None must be True or False$'),
    # The options Hugging Face families need (tests/unit/test_hf_options.py).
    ('model.norm_eps', 0.0, r'model.norm_eps=0.0 must be a positive finite number$'),
    ('model.norm_eps', float('nan'), 'model.norm_eps=nan must be a positive'),
    ('model.embed_scale', 'scaled', r"model.embed_scale='scaled' is not valid; valid values: none, "
                                    'plain, sqrt_d$'),
    ('model.output_bias', None, 'model.output_bias=None must be True or False$'),
    ('model.attention_out_bias', None, 'model.attention_out_bias=None must be True or False$'),
    ('model.ffn', 'gelu_new', "model.ffn='gelu_new' is not valid; valid values: geglu, gelu, "
                              'gelu_tanh, relu, swiglu$'),
    ('model.rope_scaling', 'longrope', "model.rope_scaling='longrope' is not valid; valid values: "
                                       'dynamic, llama3, none, ntk, pi, yarn$'),
    ('model.rope_original_length', -1, r'model.rope_original_length=-1 must be an integer >= 0 '
                                       r'\(0 = data.max_length\)$'),
    ('model.rope_low_freq_factor', 0.0, 'model.rope_low_freq_factor=0.0 must be a positive'),
    ('model.rope_high_freq_factor', 0.5, 'model.rope_high_freq_factor=0.5 must be > '
                                         'model.rope_low_freq_factor=1.0$'),
    ('model.rope_yarn_beta_fast', 1.0, 'model.rope_yarn_beta_fast=1.0 must be > '
                                       'model.rope_yarn_beta_slow=1.0$'),
    ('model.rope_yarn_beta_slow', float('inf'), 'model.rope_yarn_beta_slow=inf must be a positive'),
    ('model.rope_attention_factor', -1.0, 'model.rope_attention_factor=-1.0 must be a '
                                          'non-negative finite number$'),
    ('model.max_positions', -1, r'model.max_positions=-1 must be an integer >= 0 \(0 = '
                                r'data.max_length\)$'),
    ('model.max_positions', 1024, r"model.max_positions=1024 sets the learned table's rows, which "
                                  r"model.position='\w+' does not use; valid here: 0 \(or "
                                  r"model.position='learned'\)$"),
    ('model.vocab_size', -5, r"model.vocab_size=-5 must be an integer >= 0 \(0 = the "
                             r"tokenizer's\)$"),
    ('model.vocab_size', None, 'model.vocab_size=None must be an integer >= 0'),
]


@pytest.mark.parametrize('field,value,message', BAD_VALUES,
                         ids=[f'{f}={v}' for f, v, _ in BAD_VALUES])
def test_bad_config_values_are_one_line(field, value, message):
  config = validation.resolve(decoder_only.get_config())
  section, name = field.split('.')
  config[section][name] = value
  with pytest.raises(options.ConfigError, match=f'^{message}') as e:
    validation.validate(config)
  assert '\n' not in str(e.value)


# The splash kernel (TPU only) with what it does not take, validated for a TPU target (as
# tools.aot validates on this host): each refused in one line, before anything compiles.
SPLASH_REFUSALS = [
    ({'model.position': 'alibi'}, r"model.position='alibi' adds ALiBi slopes, which "
     r"model.attention_impl='splash' cannot take; valid values: blockwise, cudnn, pallas, ring, "
     r'xla \(or model.position in: learned, nope, rope, sinusoidal, xpos\)$'),
    ({'model.position': 't5_bias'}, r"model.position='t5_bias' adds a dense \[T, S\] bias, which "
     r"model.attention_impl='splash' cannot take; valid values: blockwise, cudnn, pallas, xla "),
    ({'model.position': 'fire'}, r"model.position='fire' adds a learned bias function .* which "
     r"model.attention_impl='splash' cannot take; valid values: blockwise, xla "),
    ({'model.position': 'kerple'}, r"model.position='kerple' adds a learned bias function .* "
     r"which model.attention_impl='splash' cannot take; valid values: blockwise, xla "),
    ({'model.attention_dropout': 0.1}, r"model.attention_dropout=0.1 is not implemented by "
     r"model.attention_impl='splash'; valid values with attention dropout: blockwise, xla "),
    ({'mesh.sequence': 2}, r"model.attention_impl='splash' holds the whole sequence on each "
     r'device .* valid: mesh.sequence=1, or model.attention_impl in: ring'),
]


@pytest.mark.parametrize('fields,message', SPLASH_REFUSALS,
                         ids=[next(iter(f)) for f, _ in SPLASH_REFUSALS])
def test_splash_with_what_it_does_not_take_is_one_line(fields, message):
  config = decoder_only.get_config()
  config.model.attention_impl = 'splash'
  for field, value in fields.items():
    section, name = field.split('.')
    config[section][name] = value
  config = validation.resolve(config)
  with attention.compiling_for('tpu'), pytest.raises(options.ConfigError,
                                                     match=f'^{message}') as e:
    validation.validate(config)
  assert '\n' not in str(e.value)


@pytest.mark.parametrize('arch', ['decoder_only', 'encoder_only', 'encoder_decoder',
                                  'rnn_seq2seq'])
def test_softcap_and_z_loss_are_accepted_on_every_arch(arch):
  """Gemma 2's c = 30 and PaLM's z = 1e-4 (integers too), with the tiled loss where it exists."""
  for softcap, z_loss, chunk in ((30.0, 1e-4, 0), (30, 0, 0), (0.0, 1, 0), (30.0, 1e-4, 16)):
    config = validation.resolve(decoder_only.get_config())
    config.model.update(arch=arch, final_logit_softcap=softcap)
    config.train.update(z_loss=z_loss, loss_chunk=0 if arch == 'rnn_seq2seq' else chunk)
    if arch == 'rnn_seq2seq':
      config.data.packing = 'none'
    validation.validate(config)


# --- eval.py's flags ---------------------------------------------------------------------------

EVAL_DEFAULTS = dict(split=['validation', 'test'], max_examples=0, lengths=[], modes=[
    'non_overlapping', 'sliding'], stride=0.5, num_beams=4, length_penalty=0.6, temperature=1.0,
                     top_k=0, top_p=1.0, plot_attention=0, rope_scaling=None)
BAD_EVAL_FLAGS = [
    ('lengths', ['0'], "--lengths=0: '0' is not valid"),
    ('lengths', ['-1'], "--lengths=-1: '-1' is not valid"),
    ('lengths', ['abc'], "--lengths=abc: 'abc' is not valid"),
    ('lengths', ['1', 'nan'], "--lengths=1,nan: 'nan' is not valid"),
    ('num_beams', 0, '--num_beams=0 must be a positive integer'),
    ('num_beams', -1, '--num_beams=-1 must be a positive integer'),
    ('split', [], '--split= names an empty split'),
    ('split', ['test', ''], '--split=test, names an empty split'),
    ('top_p', 2.0, r'--top_p=2.0 must be in \(0, 1\]'),
    ('top_p', 0.0, r'--top_p=0.0 must be in \(0, 1\]'),
    ('temperature', 0.0, '--temperature=0.0 is refused: .*for greedy decoding use --decode=greedy'),
    ('temperature', -1.0, '--temperature=-1.0 is refused'),
    ('stride', 0.0, r'--stride=0.0 must be in \(0, 1\]'),
    ('max_examples', -1, '--max_examples=-1 must be >= 0'),
    ('stream_tokens', -5, r'--stream_tokens=-5 must be >= 0 \(0 = the whole stream\)'),
    ('top_k', -2, '--top_k=-2 must be >= 0'),
    ('modes', ['sideways'], '--modes=sideways is not valid; valid: non_overlapping, sliding'),
    ('rope_scaling', 'ntk', '--rope_scaling=ntk is not valid; valid: none, or pi:F'),
    ('rope_scaling', 'ntk:0.5', '--rope_scaling=ntk:0.5 is not valid'),
    ('rope_scaling', 'warp:2', '--rope_scaling=warp:2 is not valid'),
    ('plot_attention', -1, '--plot_attention=-1 must be >= 0'),
]


@pytest.mark.parametrize('flag,value,message', BAD_EVAL_FLAGS,
                         ids=[f'{f}={v}' for f, v, _ in BAD_EVAL_FLAGS])
def test_bad_eval_flags_are_one_line(flag, value, message):
  with pytest.raises(options.ConfigError, match=message) as e:
    eval_checks.check_eval_flags(**{**EVAL_DEFAULTS, flag: value})
  assert '\n' not in str(e.value)


def test_good_eval_flags_pass_and_lengths_become_numbers():
  assert eval_checks.check_eval_flags(**EVAL_DEFAULTS) == []
  assert eval_checks.check_eval_flags(**{**EVAL_DEFAULTS, 'lengths': ['1', '2.5'],
                                        'rope_scaling': 'ntk:4'}) == [1.0, 2.5]
  assert eval_checks.check_eval_flags(**{**EVAL_DEFAULTS, 'rope_scaling': 'none'}) == []


def _fake_run(path, data_dir, **model):
  config = decoder_only.get_config('quick')
  config.data.data_dir = str(data_dir)
  config.model.update(model)
  os.makedirs(path, exist_ok=True)
  (path / 'config.json').write_text(config.to_json_best_effort())
  return config


def test_eval_lengths_beyond_the_model_or_the_stream_are_refused(tmp_path, data_dir):
  learned = tmp_path / 'learned'
  config = _fake_run(learned, data_dir, position='learned')
  length = config.data.max_length
  run = dict(split=['test'], translate=[], stream_split='test', rope_scaling=None)
  eval_checks.check_eval_run(str(learned), lengths=[1.0], **run)
  with pytest.raises(options.ConfigError, match=f'2 x data.max_length={length} = {2 * length} '
                     f'positions; .*table has max_length={length} rows; valid: multiples <= 1'):
    eval_checks.check_eval_run(str(learned), lengths=[2.0], **run)
  rope = tmp_path / 'rope'
  _fake_run(rope, data_dir, position='rope')
  eval_checks.check_eval_run(str(rope), lengths=[4.0], **run)
  with pytest.raises(options.ConfigError, match=f'1000 x data.max_length={length} = '
                     f"{1000 * length} tokens, longer than the 'test' stream") as e:
    eval_checks.check_eval_run(str(rope), lengths=[1000.0], **run)
  limit = int(str(e.value).rsplit('<= ', 1)[1])
  eval_checks.check_eval_run(str(rope), lengths=[float(limit)], **run)  # the largest that fits
  with pytest.raises(options.ConfigError, match=f"4 x data.max_length={length} = {4 * length} "
                     f"tokens, longer than the 'test' stream \\({3 * length} tokens kept by "
                     "--stream_tokens\\); valid: multiples <= 2"):
    eval_checks.check_eval_run(str(rope), lengths=[4.0], stream_tokens=3 * length, **run)
  with pytest.raises(options.ConfigError, match='is under one token'):
    eval_checks.check_eval_run(str(rope), lengths=[0.001], **run)
  with pytest.raises(options.ConfigError, match="'nosuch' is not a split of this run"):
    eval_checks.check_eval_run(str(rope), lengths=[], **{**run, 'split': ['test', 'nosuch']})
  with pytest.raises(options.ConfigError, match="needs a run with model.position='rope'"):
    eval_checks.check_eval_run(str(learned), lengths=[], **{**run, 'rope_scaling': 'ntk:2'})


def test_eval_position_overrides_are_checked_against_the_run(tmp_path, data_dir):
  """--position_ids needs --lengths on a randomized-positions run within its N ids; --xpos_block
  an xPos run, and a block > 0 a kernel that takes its mask."""
  run = dict(split=['test'], translate=[], stream_split='test', rope_scaling=None)
  rope = tmp_path / 'rope'
  config = _fake_run(rope, data_dir, position='rope', random_positions_max=128)
  length = config.data.max_length
  eval_checks.check_eval_run(str(rope), lengths=[1.0, 128 / length], position_ids='random', **run)
  with pytest.raises(options.ConfigError, match=r'^--position_ids=spaced: a window of '):
    eval_checks.check_eval_run(str(rope), lengths=[2 * 128 / length], position_ids='spaced', **run)
  with pytest.raises(options.ConfigError, match=r'^--position_ids=random sets the ids of the '
                                                   r'--lengths stream windows'):
    eval_checks.check_eval_run(str(rope), lengths=[], position_ids='random', **run)
  with pytest.raises(options.ConfigError, match=r"^--xpos_block=0 needs a run with "
                                                   r"model.position='xpos'; this one has 'rope'$"):
    eval_checks.check_eval_run(str(rope), lengths=[1.0], xpos_block=0, **run)
  xpos = tmp_path / 'xpos'
  _fake_run(xpos, data_dir, position='xpos', xpos_block=16, attention_impl='blockwise')
  eval_checks.check_eval_run(str(xpos), lengths=[2.0], xpos_block=0, **run)
  with pytest.raises(options.ConfigError, match=r'^--position_ids=random draws ids'):
    eval_checks.check_eval_run(str(xpos), lengths=[1.0], position_ids='random', **run)
  with pytest.raises(options.ConfigError, match=r'^--xpos_block=-1 must be an integer >= 0'):
    eval_checks.check_eval_run(str(xpos), lengths=[1.0], xpos_block=-1, **run)
  window = tmp_path / 'window'
  _fake_run(window, data_dir, position='xpos', attention='sliding_window')
  with pytest.raises(options.ConfigError, match=r"^--xpos_block=8: model.position='xpos' adds "
                                                   r'a \[T, S\] mask'):
    eval_checks.check_eval_run(str(window), lengths=[1.0], xpos_block=8, **run)


def test_eval_json_must_be_writable(tmp_path):
  eval_checks.check_can_write(str(tmp_path), 'eval.json')
  assert os.listdir(tmp_path) == []  # the probe leaves nothing behind
  os.makedirs(tmp_path / 'eval.json')
  with pytest.raises(options.ConfigError, match='eval.json is a directory'):
    eval_checks.check_can_write(str(tmp_path), 'eval.json')
  with pytest.raises(options.ConfigError, match=r'cannot write eval.json in .* \(No such file'):
    eval_checks.check_can_write(str(tmp_path / 'missing'), 'eval.json')


# --- Sweeps ----------------------------------------------------------------------------------

def test_sweep_seeds_and_files_that_cannot_load(tmp_path):
  with pytest.raises(sweep_spec.SweepError, match="--seeds=a,b: 'a' is not an integer"):
    sweep_spec.expand({}, seeds=['a', 'b'])
  assert [c['seed'] for c in sweep_spec.expand({}, seeds=['3', '4'])] == [3, 4]
  path = tmp_path / 'broken.py'
  path.write_text('def get_sweep(:\n  pass\n')
  with pytest.raises(sweep_spec.SweepError, match=f'sweep file {path} line 1: syntax error'):
    sweep_spec.load_sweep_module(str(path))
  path.write_text('def get_config(arg=None):\n  raise ValueError("no")\n\n'
                  'def get_sweep():\n  return [1]\n')
  module = sweep_spec.load_sweep_module(str(path))
  with pytest.raises(sweep_spec.SweepError, match='returned list'):
    sweep_spec.get_sweep(module)
  with pytest.raises(sweep_spec.SweepError,
                     match=r"get_config\(None\) of .* raised ValueError: no"):
    sweep_spec.cell_config(module, None, {'name': 'seed=0', 'overrides': {}, 'seed': 0})


SWEEP = '''
from configs import decoder_only


def get_config(arg=None):
  return decoder_only.get_config('quick')


def get_sweep():
  return {'grid': {'model.ffn': ['relu', 'gelu', 'swiglu']}}
'''


@pytest.mark.parametrize('parallel', [1, 2])
def test_a_signal_stops_the_running_cells_and_starts_no_other(tmp_path, parallel):
  """The signal arrives while the first `parallel` cells run: they end (as train.py does, 128 + N
  after saving), the queued one never starts, and run_sweep raises Stopped."""
  spec = tmp_path / 'sweep.py'
  spec.write_text(SWEEP)
  children = processes.Children()
  # Once every running cell has started, the signal comes (the barrier's action, run before any
  # cell returns).
  barrier = threading.Barrier(parallel, action=lambda: children.forward(signal.SIGTERM))
  launched = []

  def launch(argv, log_path, env):
    del log_path, env
    launched.append(argv)
    barrier.wait(timeout=30)
    return 128 + signal.SIGTERM

  with pytest.raises(sweep_runner.Stopped) as e:
    sweep_runner.run_sweep(str(spec), str(tmp_path / 'sw'), parallel=parallel, launch=launch,
                           children=children, out=open(os.devnull, 'w'))
  assert e.value.signum == signal.SIGTERM and len(launched) == parallel
  results = list(e.value.results.values())
  assert sorted(results) == sorted(['stopped (rc 143)'] * parallel
                                   + ['not started'] * (3 - parallel))
  assert len(os.listdir(tmp_path / 'sw')) == parallel  # no workdir for a cell never started
