"""Building blocks shared by model files: attention, norms, MLPs, experts, rotary embedding, linear layers, sampler."""
