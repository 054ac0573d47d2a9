"""Attention over the paged KV cache in plain torch: dense caches (reference.py) and TurboQuant
codes (turboquant.py), and the per-step metadata they read (metadata.py). A backend picks the
implementation of each layer and may hand these a faster kernel for decode queries."""
