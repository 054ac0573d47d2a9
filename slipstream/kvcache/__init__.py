"""KV-cache storage and compression (paged blocks, TurboQuant codes)."""
