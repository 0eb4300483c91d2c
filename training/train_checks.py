"""A training run's checks before anything compiles (`check_train_run`): the config's fields, the
workdir and data_dir, the mesh against the devices, and a text corpus against the one the run
started on (`check_corpus`, also eval.py's). Each bad input is a one-line ConfigError (or
text_corpus.DataError)."""

from data import pipeline
from data import python_code
from data import text_corpus
from layers.options import ConfigError
from training import cli_checks
from training import distributed
from training import paths
from training import validation


def check_train_run(config, workdir):
  """Everything about a training run that can be checked before compiling: the config's fields
  (missing ones named), the workdir and data_dir, and the mesh against the devices. Returns the
  resolved config."""
  cli_checks.check_workdir(workdir)
  try:
    config = validation.resolve(config)
    validation.validate(config)
  except (AttributeError, KeyError) as e:  # a config file that left out a field default.py has
    raise ConfigError(f'the config lacks a field ({type(e).__name__}: {e}); valid: every field of '
                      'configs/default.py') from None
  for what, path in (('--workdir', workdir), ('data.data_dir', config.data.data_dir),
                     ('train.init_from', config.train.get('init_from', ''))):
    if path:
      paths.check_store_reachable(path, what)
  validation.check_writable('workdir', workdir)
  for name in ('checkpoints',):  # the directories the run writes into
    path = paths.join(workdir, name)
    if paths.exists(path) and not paths.isdir(path):
      raise ConfigError(f'{path} is a file, where the run keeps its checkpoints; valid: a '
                        'directory (move the file away, or use a new --workdir)')
  validation.check_writable('data.data_dir', config.data.data_dir)
  distributed.make_mesh(config)  # the sizes' product against the device count
  check_corpus(config, workdir)  # a resumed run: before new files get a tokenizer of their own
  return config


def check_corpus(config, workdir):
  """For data.task text_pairs / text_lm: the input files against those the run in `workdir`
  started training on (run_info.json 'corpus', written by the loop; a new run has none).

  Changed files would be prepared into a new folder with a new tokenizer, silently paired with the
  run's model. Raises text_corpus.DataError naming the file that changed.
  """
  spec = pipeline.text_spec(config.data)
  if spec is None:
    return
  path = paths.join(workdir, 'run_info.json')
  info = paths.read_json(path) if paths.exists(path) else {}
  code = info.get('python_code')
  if code and config.data.get('task') == python_code.TASK:  # the interpreter and files first
    now = python_code.corpus_of(config.data).record()
    if (now['python'], now['files_hash']) != (code['python'], code['files_hash']):
      raise text_corpus.DataError(
          f"data.task='python_code': this run trained on the stdlib of Python {code['python']} "
          f"(files hash {code['files_hash']}); this interpreter and data.code_max_files give "
          f"Python {now['python']} (files hash {now['files_hash']}); valid: the same "
          'interpreter and data.code_max_files, or a new workdir')
  recorded = info.get('corpus')
  if recorded:  # runs from before the record: nothing to compare with
    text_corpus.check_fingerprint(recorded, spec)
