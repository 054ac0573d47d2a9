"""Attention over the paged KV cache, and the per-step metadata it reads."""
