"""Hugging Face checkpoint formats of the decoder-only models: configs (families) and tensors
(weights). The conversion itself, with its command line, is tools/hf."""
