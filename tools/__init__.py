"""Command-line tools over the training library: sweeps, comparisons, accounting."""

from training import host

# Before JAX starts (any tool may import it): on a host with no accelerator device the tools run on
# the CPU without libtpu's start-up probe and its five lines of errors, as train.py and eval.py do.
host.cpu_when_no_accelerator()
