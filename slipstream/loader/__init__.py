"""Reading models from disk: bundled aliases, GGUF files, HF checkpoints, tokenizers (never model code)."""
