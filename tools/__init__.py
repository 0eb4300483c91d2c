"""Command-line tools over the training library: sweeps, comparisons, accounting."""
