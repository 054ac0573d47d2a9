"""Turning a model name into a ready model: bundled aliases, GGUF files, HF checkpoints."""
