"""Pictures: the style every picture shares, and the pictures of one run (eval.py, comparisons)."""
