"""The training library: state, steps, loop, checkpointing, evaluation, validation."""
