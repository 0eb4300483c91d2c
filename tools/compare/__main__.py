"""`python -m tools.compare`: the command line of tools/compare/comparison.py."""

from absl import app

from tools.compare import comparison

if __name__ == '__main__':
  comparison.define_flags()
  app.run(comparison.main)
