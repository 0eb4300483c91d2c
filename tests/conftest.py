"""Fixtures shared across test modules."""

import pytest


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """A fresh data dir per module: the toy dataset is generated into it on first use."""
  return tmp_path_factory.mktemp('tfds')
