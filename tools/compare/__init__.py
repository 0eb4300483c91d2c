"""Comparing train.py runs (`python -m tools.compare`): tables, figures, legend, statistics."""
