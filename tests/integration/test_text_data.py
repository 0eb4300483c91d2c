"""Your own data through the command lines: an encoder-decoder trained on a generated TSV corpus
(2,000 pairs of real words) until its loss falls and evaluated (BLEU, exact match), a decoder-only
LM on text files with the extrapolation harness, the prepared folder reused by eval.py, each
bad input as one line with exit status 2 and data_dir left clean (a pair-only eval flag on a text_lm
run, an input file changed since training), and the accounting CLI's SentencePiece vocabulary."""

import json
import os
import subprocess
import sys

from etils import epath
import pytest

from data import text_corpus
from tests.helpers import ROOT, gcs_emulator, metric_rows
from tests.unit.test_text_data import data_config, write_corpus

TRAIN = os.path.join(ROOT, 'train.py')
EVAL = os.path.join(ROOT, 'eval.py')
# A tiny model (configs' `quick`) for a few CPU seconds of training.
# A constant rate after warmup: the loss falls furthest in these few steps.
SMALL = ['--config.train.batch_size=32', '--config.train.log_every=10',
         '--config.train.warmup_steps=10', '--config.train.learning_rate=3e-3',
         '--config.train.schedule=constant']


def cli(*args, timeout=300):  # generous: a shared 2-core machine may run slower than CI
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def pairs_args(corpus_dir, data_dir, workdir, steps=80):
  return [TRAIN, f'--config={ROOT}/configs/text_pairs.py:dir={corpus_dir},quick',
          f'--workdir={workdir}', f'--config.data.data_dir={data_dir}',
          '--config.data.vocab_size=160', '--config.data.max_length=40',
          f'--config.train.steps={steps}', f'--config.train.eval_every={steps}',
          f'--config.train.checkpoint_every={steps}', *SMALL]


@pytest.fixture(scope='module')
def pairs_run(tmp_path_factory):
  """(workdir, data_dir) of an encoder-decoder trained 80 steps on the generated TSV corpus."""
  root = tmp_path_factory.mktemp('text_pairs')
  write_corpus(str(root / 'corpus'))
  out = cli(*pairs_args(root / 'corpus', root / 'data', root / 'run'))
  assert out.returncode == 0, out.stderr[-3000:]
  return root / 'run', root / 'data'


def test_text_pairs_trains_until_the_loss_falls(pairs_run):
  workdir, data_dir = pairs_run
  losses = [row['loss'] for row in metric_rows(str(workdir))]
  assert len(losses) == 8 and losses[-1] < 0.4 * losses[0], losses  # measured: 5.0 -> 0.8
  assert metric_rows(str(workdir), 'valid')  # the validation file was evaluated
  folders = os.listdir(data_dir / 'text_pairs')
  assert len(folders) == 1 and folders[0].startswith('vocab160-shared-'), folders
  assert {'spm.model', 'corpus.json', 'dataset_info.json'} <= set(
      os.listdir(data_dir / 'text_pairs' / folders[0]))


def test_text_pairs_evaluates_with_bleu_on_detokenized_text(pairs_run):
  workdir, data_dir = pairs_run
  folder = os.listdir(data_dir / 'text_pairs')[0]
  mtime = os.stat(data_dir / 'text_pairs' / folder / 'corpus.json').st_mtime_ns
  out = cli(EVAL, f'--workdir={workdir}', '--split=test', '--max_examples=32')
  assert out.returncode == 0, out.stderr[-3000:]
  with open(workdir / 'eval.json') as f:
    result = json.load(f)
  test = result['translation']['test']
  assert test['n'] == 32 and 0 < test['bleu'] <= 100 and 0 <= result['exact_match'] <= 1
  # Outputs are detokenized text (SentencePiece's '▁' gone), in the corpus's own language.
  assert all('▁' not in s['output'] and s['reference'].startswith('Die ')
             for s in test['samples'])
  assert result['loss']['test'] < 1.5  # measured: 0.73
  # eval.py reused the prepared folder: nothing re-prepared, nothing added.
  assert os.listdir(data_dir / 'text_pairs') == [folder]
  assert os.stat(data_dir / 'text_pairs' / folder / 'corpus.json').st_mtime_ns == mtime


def lm_args(root):
  return [TRAIN, f'--config={ROOT}/configs/text_lm.py:dir={root / "corpus"},quick',
          f'--workdir={root / "run"}', f'--config.data.data_dir={root / "data"}',
          '--config.data.vocab_size=96', '--config.data.max_length=64',
          '--config.train.steps=50', '--config.train.eval_every=50',
          '--config.train.checkpoint_every=50', '--config.train.batch_size=16', *SMALL[1:]]


@pytest.fixture(scope='module')
def lm_run(tmp_path_factory):
  """(workdir, data_dir) of a decoder-only LM trained 50 steps on generated documents."""
  root = tmp_path_factory.mktemp('text_lm')
  write_corpus(str(root / 'corpus'), num_train=300, num_eval=40, lm=True)
  out = cli(*lm_args(root))
  assert out.returncode == 0, out.stderr[-3000:]
  return root / 'run', root / 'data'


def test_text_lm_trains_until_the_loss_falls(lm_run):
  workdir, data_dir = lm_run
  losses = [row['loss'] for row in metric_rows(str(workdir))]
  assert len(losses) == 5 and losses[-1] < 0.5 * losses[0], losses  # measured: 4.9 -> 1.4
  assert os.listdir(data_dir / 'text_lm')[0].startswith('vocab96-shared-')


def test_text_lm_evaluates_loss_and_extrapolation(lm_run):
  workdir, _ = lm_run
  out = cli(EVAL, f'--workdir={workdir}', '--split=test', '--lengths=1,2',
            '--modes=non_overlapping')
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith('test: loss ') and 'extrapolation x2 L=128' in out.stdout
  with open(workdir / 'eval.json') as f:
    result = json.load(f)
  assert result['translation'] == {} and result['loss']['test'] < 2.5
  assert [(r['length'], r['mode']) for r in result['extrapolation']] == [
      (64, 'non_overlapping'), (128, 'non_overlapping')]


def test_text_lm_eval_refuses_plot_attention_in_one_line(lm_run):
  """It drew a pair's attention and ended in a traceback on documents (pipeline.load_examples)."""
  workdir, _ = lm_run
  out = cli(EVAL, f'--workdir={workdir}', '--split=test', '--plot_attention=2')
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
  assert lines[0] == ("eval: --plot_attention=2 draws a pair's target-to-source attention; "
                      "data.task='text_lm' holds documents, not sentence pairs; valid: 0")


def test_an_input_file_changed_since_training_is_refused(lm_run):
  """eval.py and a resumed train.py name the changed file, before a new folder and tokenizer are
  prepared for it (the run's model was trained with the old ones)."""
  workdir, data_dir = lm_run
  with open(workdir / 'run_info.json') as f:
    corpus = json.load(f)['corpus']
  folders = os.listdir(data_dir / 'text_lm')
  assert folders == [os.path.basename(corpus['folder'])] and folders[0].endswith(corpus['hash'])
  path = corpus['files']['test']
  with open(path, 'rb') as f:
    original = f.read()
  try:
    with open(path, 'ab') as f:
      f.write(b'The old farmer writes a letter again.\n')
    needle = f'data.files.test={path} changed since the run started training'
    for prefix, args in (('eval', [EVAL, f'--workdir={workdir}', '--split=test']),
                         ('data error', lm_args(workdir.parent))):
      out = cli(*args)
      lines = out.stderr.strip().splitlines()
      assert out.returncode == 2 and len(lines) == 1, (prefix, out.returncode, out.stderr[-3000:])
      assert lines[0].startswith(f'{prefix}: {needle}') and corpus['folder'] in lines[0], lines[0]
    assert os.listdir(data_dir / 'text_lm') == folders  # nothing prepared for the changed file
  finally:
    with open(path, 'wb') as f:
      f.write(original)


def test_accounting_cli_counts_the_sentencepiece_vocabulary():
  """Two models of 500 pieces share the 6 specials: V = 994, not the toy task's 166; the files
  are not read (they need not exist)."""
  out = cli('-m', 'tools.accounting', '--config=configs/text_pairs.py:dir=/no/corpus,quick',
            '--config.data.vocab_size=500', '--config.data.shared_vocab=False')
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.startswith('# Accounting: ') and ', V=994, ' in out.stdout.splitlines()[0]


# (file to replace, its bytes or None, extra flags, words the one line holds): each exits 2 and
# leaves data_dir clean.
BAD_INPUTS = [
    ('train', b'The cat sees.\tDie katze sieht.\nThe dog sees the cat\n', [],
     ['data error:', 'line 2: no tab']),
    ('validation', b'', [], ['data error:', 'validation.tsv is empty']),
    ('test', b'The cat sees.\tDie katze sieht.\nThe caf\xe9.\tDas caf\xe9.\n', [],
     ['data error:', 'test.tsv line 2: not UTF-8']),
    (None, None, ['--config.data.vocab_size=5000'],
     ['data error:', 'data.vocab_size=5000', 'Please set it to a value <=']),
    (None, None, ['--config.data.files.test='], ['config error:', "data.files.test=''"]),
]


@pytest.mark.parametrize('split,content,flags,needles', BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(tmp_path, split, content, flags, needles):
  corpus = write_corpus(str(tmp_path / 'corpus'), num_train=300, num_eval=20)
  if split:
    with open(corpus[split], 'wb') as f:
      f.write(content)
  data_dir = tmp_path / 'data'
  out = cli(*pairs_args(tmp_path / 'corpus', data_dir, tmp_path / 'run'), *flags)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
  for needle in needles:
    assert needle in lines[0], lines[0]
  if split:
    assert f'data.files.{split}={corpus[split]}' in lines[0]
  assert not data_dir.exists()  # nothing half-written


@pytest.fixture(scope='module')
def gcs():
  """An in-memory GCS emulator (gcp-storage-emulator) with the bucket `bucket`, gcsfs pointed at it
  through its own settings (this process only: these tests read and write in-process)."""
  with gcs_emulator() as url:
    yield url


def test_input_files_on_gs(gcs, tmp_path):
  """data.files on object storage (the GCS emulator), read through etils.epath: the
  same corpus, hence the same folder, as from local copies; a bad line names the gs:// file."""
  del gcs  # the environment points gcsfs at the emulator
  local = write_corpus(str(tmp_path / 'corpus'), num_train=300, num_eval=20)
  remote = {}
  for split, path in local.items():
    remote[split] = f'gs://bucket/corpus/{split}.tsv'
    epath.Path(remote[split]).write_bytes(open(path, 'rb').read())
  folders = [text_corpus.prepare(text_corpus.spec_from_config(
      data_config(files, tmp_path / 'data'))) for files in (remote, local)]
  assert folders[0] == folders[1] and text_corpus.read_split(folders[0], 'test')[0] == tuple(
      open(local['test'], encoding='utf-8').readline().rstrip('\n').split('\t'))
  epath.Path(remote['validation']).write_bytes(b'A\tB\nno tab here\n')
  with pytest.raises(text_corpus.DataError, match=(
      'data.files.validation=gs://bucket/corpus/validation.tsv line 2: no tab')):
    text_corpus.prepare(text_corpus.spec_from_config(data_config(remote, tmp_path / 'data2')))
  assert not (tmp_path / 'data2').exists()


def test_prepared_folder_on_gs_is_uploaded_once_and_downloaded(gcs, tmp_path, monkeypatch):
  """A gs:// data_dir: the first host prepares and uploads (corpus.json last), a host with an empty
  cache downloads the same folder instead of preparing it."""
  del gcs
  files = write_corpus(str(tmp_path / 'corpus'), num_train=300, num_eval=20)
  config = data_config(files, 'gs://bucket/text_data')
  monkeypatch.setenv('ATTNLAB_DATA_CACHE', str(tmp_path / 'cache1'))
  first = text_corpus.prepare(text_corpus.spec_from_config(config))
  assert first.startswith(str(tmp_path / 'cache1'))
  remote = epath.Path('gs://bucket/text_data/text_pairs') / os.path.basename(first)
  assert sorted(c.name for c in remote.iterdir()) == sorted(os.listdir(first))

  def no_build(*args):
    raise AssertionError('prepared again instead of downloaded')
  monkeypatch.setattr(text_corpus, '_build', no_build)
  monkeypatch.setenv('ATTNLAB_DATA_CACHE', str(tmp_path / 'cache2'))
  second = text_corpus.prepare(text_corpus.spec_from_config(config))
  assert second.startswith(str(tmp_path / 'cache2'))
  for name in os.listdir(first):
    with open(os.path.join(first, name), 'rb') as a, open(os.path.join(second, name), 'rb') as b:
      assert a.read() == b.read(), name
  assert text_corpus.read_split(second, 'test') == text_corpus.read_split(first, 'test')
