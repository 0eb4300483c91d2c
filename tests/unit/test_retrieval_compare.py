"""tools.compare.retrieval: the passkey retrieval table (accuracy by length, mean [min, max] across
seeds, the evaluation variants in rows of their own) and the heat maps, also through
tools.compare."""

import json
import os

from tools.compare import comparison as compare
from tools.compare import retrieval as retrieval_compare
from tools.compare import runs as runs_lib
from tools.compare import summary as summary_lib


def _workdir(root, position, seed, accuracy, variant=None):
  """A finished passkey run whose retrieval report at 16 and 32 tokens has `accuracy(length,
  depth)` in every cell; `variant` adds eval_<variant>.json at half those accuracies."""
  path = os.path.join(root, f'model.position={position},seed={seed}')
  os.makedirs(path)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'model': {'position': position}, 'train': {'seed': seed},
               'data': {'max_length': 16, 'task': 'passkey'}}, f)
  with open(os.path.join(path, 'metrics.jsonl'), 'w') as f:
    for step in (1, 2):
      f.write(json.dumps({'step': step, 'split': 'train', 'loss': 3.0 - step}) + '\n')
  report = {str(n): {f'{d:.1f}': accuracy(n, d) for d in (0.0, 0.5, 1.0)} for n in (16, 32)}
  with open(os.path.join(path, 'eval.json'), 'w') as f:
    json.dump({'retrieval': report}, f)
  if variant:
    half = {n: {d: a / 2 for d, a in row.items()} for n, row in report.items()}
    with open(os.path.join(path, f'eval_{variant}.json'), 'w') as f:
      json.dump({'retrieval': half}, f)


def test_table_by_length_across_seeds_and_variants(tmp_path):
  # rope: seed s retrieves everything at 16 tokens, and at 32 only at depth 0 (seed 0) or at
  # depths 0 and 0.5 (seed 1); alibi: everything.
  _workdir(tmp_path, 'rope', 0, lambda n, d: 1.0 if n == 16 or d == 0.0 else 0.0, 'ntk')
  _workdir(tmp_path, 'rope', 1, lambda n, d: 1.0 if n == 16 or d <= 0.5 else 0.0, 'ntk')
  _workdir(tmp_path, 'alibi', 0, lambda n, d: 1.0)
  groups = summary_lib.group_runs([runs_lib.load_run(w) for w in runs_lib.find_runs(
      [str(tmp_path)])])
  rows = retrieval_compare.cell_rows(groups)
  assert sorted(label for label, _, _ in rows) == ['position=alibi', 'position=rope',
                                                   'position=rope [eval ntk]']
  table = retrieval_compare.markdown_table(rows).splitlines()
  assert table[0] == '| cell | seeds | trained at | 16 tokens | 32 tokens |'
  line = {row.split(' | ')[0][2:]: row for row in table[2:5]}
  assert line['position=rope'] == '| position=rope | 2 | 16 | 100.0 [100, 100] | 50.0 [33, 67] |'
  assert line['position=rope [eval ntk]'] == ('| position=rope [eval ntk] | 2 | 16 | 50.0 [50, 50] '
                                              '| 25.0 [17, 33] |')
  assert line['position=alibi'] == '| position=alibi | 1 | 16 | 100.0 | 100.0 |'
  mean = retrieval_compare.mean_report([r for label, _, r in rows if label == 'position=rope'][0])
  assert mean['32'] == {'0.0': 1.0, '0.5': 0.5, '1.0': 0.0}
  # Through tools.compare: the table after the summary, the heat maps beside the picture.
  out = str(tmp_path / 'cmp.png')
  text = compare.compare([str(tmp_path)], out)
  assert '| position=rope | 2 | 16 | 100.0 [100, 100] | 50.0 [33, 67] |' in text
  assert os.path.getsize(str(tmp_path / 'cmp_retrieval.png')) > 10_000


def test_runs_without_a_retrieval_report_add_nothing(tmp_path):
  _workdir(tmp_path, 'rope', 0, lambda n, d: 1.0)
  os.remove(os.path.join(tmp_path, 'model.position=rope,seed=0', 'eval.json'))
  out = str(tmp_path / 'cmp.png')
  assert 'tokens |' not in compare.compare([str(tmp_path)], out)
  assert not os.path.exists(str(tmp_path / 'cmp_retrieval.png'))


def test_line_figure_in_units_of_L_with_fine_tunes_marked(tmp_path):
  """The accuracy-against-length lines: ticks in units of the shortest training length, a cell
  trained from another run's parameters at 2L labelled as a fine-tune."""
  _workdir(tmp_path, 'rope', 0, lambda n, d: 1.0 if n == 16 else 0.5)
  _workdir(tmp_path, 'rope', 1, lambda n, d: 1.0 if n == 16 else 0.0)
  _workdir(tmp_path, 'rope', 2, lambda n, d: 1.0 if n == 16 else 0.25)
  _workdir(tmp_path, 'yarn', 0, lambda n, d: 1.0)
  config_path = os.path.join(tmp_path, 'model.position=yarn,seed=0', 'config.json')
  with open(config_path) as f:
    config = json.load(f)
  config['data']['max_length'] = 32
  config['train']['init_from'] = 'rope_run'
  with open(config_path, 'w') as f:
    json.dump(config, f)
  groups = summary_lib.group_runs([runs_lib.load_run(w) for w in runs_lib.find_runs(
      [str(tmp_path)])])
  found = retrieval_compare._reports(groups)
  rows = retrieval_compare._labelled(found, groups)
  fig = retrieval_compare.line_figure(rows, retrieval_compare._fine_tuned(found, groups))
  ax = fig.axes[0]
  assert [t.get_text() for t in ax.get_xticklabels()] == ['1L', '2L']
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  assert any('(fine-tuned at 2L) (1)' in t for t in labels), labels
  rope = [line for line, t in zip(ax.get_lines(), labels) if 'rope' in t][0]
  assert list(rope.get_ydata()) == [100.0, 25.0]  # the seeds' mean at 16 and 32 tokens
  assert len(ax.collections) == 1  # one band: the three-seed cell's interval
  # At 32 tokens the seeds score 50, 0 and 25%: a t interval would reach -37%; the bootstrap band
  # keeps to the seeds' range.
  band = ax.collections[0].get_paths()[0].vertices  # [points, (x, y)]
  assert set(band[band[:, 0] == 2.0, 1]) == {0.0, 50.0}  # at 2L
  assert set(band[band[:, 0] == 1.0, 1]) == {100.0}
