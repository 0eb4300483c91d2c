"""Sweeps (`python -m tools.sweep`): a sweep file as cells, each run with train.py, and --tune."""
