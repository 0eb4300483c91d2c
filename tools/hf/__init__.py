"""Hugging Face checkpoints in and out: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and GPT-2."""
