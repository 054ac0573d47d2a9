"""Building blocks shared by model files: norms, rotary embedding, sampler."""
