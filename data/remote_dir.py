"""A data_dir on object storage (`gs://...`): the toy dataset is read through a local copy.

TFDS reads its array_record files with local file I/O here, and the toy corpora are a few MB, so
a gs:// data_dir is mirrored once per process into a local cache: the dataset is downloaded when
the bucket holds it whole (its tokenizer.json, written last, marks that), else generated locally
and uploaded, tokenizer.json last, for the other hosts of a pod and later runs.
"""

import functools
import os
import tempfile

from etils import epath

from data import toy_translation

CACHE = os.path.join(tempfile.gettempdir(), 'attnlab_data')  # overridden by ATTNLAB_DATA_CACHE


def _files(root, rel=''):
  """The relative paths of the files under epath `root` (a walk by listing: no `**` on gs://)."""
  out = []
  for child in sorted((root / rel).iterdir() if rel else root.iterdir()):
    name = f'{rel}/{child.name}' if rel else child.name
    out.extend(_files(root, name) if child.is_dir() else [name])
  return out


def _copy(src, dst, names):
  for name in names:
    (dst / name).parent.mkdir(parents=True, exist_ok=True)
    (dst / name).write_bytes((src / name).read_bytes())


def local_data_dir(data_dir, task):
  """The local data_dir to read `task` from: `data_dir` itself (made absolute) if it is local; for
  a gs:// one, its mirror (downloaded, or generated and uploaded)."""
  if '://' not in data_dir:
    return os.path.abspath(os.path.expanduser(data_dir))
  return _mirror(data_dir.rstrip('/'), task)


@functools.lru_cache(maxsize=None)  # once per process
def _mirror(data_dir, task):
  local = os.path.join(os.environ.get('ATTNLAB_DATA_CACHE', CACHE), data_dir.replace('://', '/'))
  sub = f'toy_translation/{task}'  # TFDS's layout: <data_dir>/<name>/<config>/<version>
  remote, mine = epath.Path(data_dir), epath.Path(local)
  tokenizer = toy_translation.TOKENIZER_FILE
  if not os.path.isdir(os.path.join(local, sub)) and (remote / sub).is_dir():
    names = [f'{sub}/{n}' for n in _files(remote / sub)]
    if any(n.endswith('/' + tokenizer) for n in names):  # whole: uploaded tokenizer last
      _copy(remote, mine, names)
  toy_translation.prepare(local, task)  # a no-op when downloaded
  have = set(_files(remote / sub)) if (remote / sub).is_dir() else set()
  names = [n for n in _files(mine / sub) if n not in have]
  names.sort(key=lambda n: n.endswith(tokenizer))
  _copy(mine, remote, [f'{sub}/{n}' for n in names])
  return local
