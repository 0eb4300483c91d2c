"""Paths that are local or on object storage (`gs://bucket/...`), through `etils.epath`.

Every path a run writes or reads (the workdir and its files, a sweep directory, compare's runs
and picture) goes through these helpers: epath is what Orbax itself uses (and what
`state.init_from` reads a source run with), and it reaches gs:// through gcsfs.
Strings in, strings out, so that messages show the path as given.

Object storage has no rename and no append: an object is written whole and appears only when its
upload completes, so `write_text` is atomic there by itself (locally it is a temporary file renamed
in). gcsfs caches directory listings per process, and consults them before reading a file; Orbax's
tensorstore and other processes (train.py under a sweep, eval.py) write behind its back, so every
helper that looks drops the cached listings of the path and its parents first.
"""

import json
import logging
import os
import socket
import urllib.parse

from etils import epath


# gcsfs logs each request that ran out of retries with its traceback; the run reports the failure
# itself, in one line (training.loop.store_lost).
logging.getLogger('gcsfs').setLevel(logging.CRITICAL)

# How long the start-up check waits for the object store to accept a connection.
STORE_CONNECT_SECS = 10


class StoreUnreachable(OSError):
  """The object store of a gs:// path cannot be reached (one line: the store and the reason)."""


def store_endpoint():
  """(host, port) of the GCS endpoint the clients use: STORAGE_EMULATOR_HOST, else Google's."""
  url = urllib.parse.urlparse(os.environ.get('STORAGE_EMULATOR_HOST') or
                              'https://storage.googleapis.com')
  return url.hostname or 'storage.googleapis.com', url.port or (443 if url.scheme == 'https'
                                                                else 80)


def check_store_reachable(path, what):
  """For a gs:// `path`: a StoreUnreachable within STORE_CONNECT_SECS when its store accepts no
  connection (DNS failure, refused, no route), instead of the clients' minutes of retries."""
  if not is_remote(path):
    return
  host, port = store_endpoint()
  try:
    socket.create_connection((host, port), timeout=STORE_CONNECT_SECS).close()
  except OSError as e:
    reason = e.strerror or type(e).__name__
    raise StoreUnreachable(f'{what}={path}: the object store {host}:{port} cannot be reached '
                           f'({reason}); check the network (or STORAGE_EMULATOR_HOST) and rerun'
                           ) from None


def is_storage_error(error):
  """Whether an exception comes from reaching the object store (connection, DNS, retries spent)."""
  for e in (error, error.__cause__, error.__context__):
    if e is None:
      continue
    module = type(e).__module__ or ''
    if module.startswith(('aiohttp', 'gcsfs', 'google.api_core', 'google.auth')) or isinstance(
        e, (ConnectionError, socket.gaierror, TimeoutError)):
      return True
  return False


def is_remote(path):
  """True for an object-store URL (gs://, s3://, ...), False for a local path."""
  return '://' in os.fspath(path)


def absolute(path):
  """A local path made absolute (with ~ expanded); a URL as given, without a trailing slash."""
  path = os.fspath(path)
  if is_remote(path):
    return path.rstrip('/')
  return os.path.abspath(os.path.expanduser(path))


def join(base, *names):
  """`base/name/...` as a string (a URL stays a URL)."""
  return os.fspath(epath.Path(base).joinpath(*names))


def basename(path):
  return epath.Path(os.fspath(path).rstrip('/')).name


def dirname(path):
  """The directory that holds `path` (a URL stays a URL)."""
  return os.fspath(epath.Path(os.fspath(path).rstrip('/')).parent)


def _fresh(path):
  """`path` as an epath.Path, with gcsfs's cached listings of it and its parents dropped."""
  p = epath.Path(path)
  if is_remote(path):
    from etils.epath import backend
    backend.fsspec_backend.fs(os.fspath(p)).invalidate_cache(os.fspath(p))
  return p


def exists(path):
  return _fresh(path).exists()


def isdir(path):
  return _fresh(path).is_dir()


def listdir(path):
  """The sorted names in directory `path` ([] when it does not exist)."""
  p = _fresh(path)
  if not p.is_dir():
    return []
  return sorted(child.name for child in p.iterdir())


def makedirs(path):
  epath.Path(path).mkdir(parents=True, exist_ok=True)


def read_text(path):
  return _fresh(path).read_text()


def read_bytes(path):
  return _fresh(path).read_bytes()


def read_json(path):
  return json.loads(read_text(path))


def write_text(path, text):
  """Writes `text` to `path` atomically: a reader sees the old contents or the new, never part."""
  write_bytes(path, text.encode())


def write_json(path, obj):
  write_text(path, json.dumps(obj, indent=2))


def rename(src, dst):
  """Renames a file or directory (on object storage: copies every object, then deletes)."""
  if is_remote(src):
    _fresh(src).rename(dst)
  else:
    os.rename(src, dst)


def replace(src, dst):
  """Moves file `src` to `dst`, replacing a `dst` that exists."""
  if is_remote(src):
    write_bytes(dst, read_bytes(src))
    epath.Path(src).unlink()
  else:
    os.replace(src, dst)


def remove(path):
  """Removes a file, or a directory and everything in it."""
  p = _fresh(path)
  if p.is_dir():
    p.rmtree()
  elif p.exists():
    p.unlink()


def write_bytes(path, data):
  """Writes `data` to `path` atomically (see `write_text`)."""
  if is_remote(path):
    epath.Path(path).write_bytes(data)  # an object appears only when its upload completes
    return
  with open(path + '.tmp', 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(path + '.tmp', path)
