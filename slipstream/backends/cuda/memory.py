"""gpu_memory_utilization (vLLM's name): the KV cache gets what a profiled forward pass leaves of a
fraction of the GPU's memory.

Owns: the profiling run (one prefill of the largest step the scheduler may send, plus its
logits, over a small temporary dense cache) and the arithmetic: KV bytes = utilization *
total - memory in use on the device after the run (weights, CUDA context, other processes)
- the activation peak above it. Must never allocate the real cache or know the scheduler.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.attention.metadata import AttentionMetadata, leading_decodes, use_metadata
from slipstream.kvcache.cache import KVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype

GiB = 2**30


def kv_cache_budget(utilization: float, total: int, in_use: int, activation_peak: int, tokens: int) -> int:
    """Bytes for the KV cache; an error naming the figures where nothing is left."""
    budget = int(utilization * total) - in_use - activation_peak
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
                         f"{utilization * total / GiB:.2f} GiB allowed, {in_use / GiB:.2f} GiB in use on the device "
                         f"and a {activation_peak / GiB:.2f} GiB activation peak for a {tokens}-token step; raise it "
                         f"or lower max_num_batched_tokens")
    return budget


@torch.inference_mode()
def profile_kv_cache_memory(model: nn.Module, backend, utilization: float, num_tokens: int, num_logits: int,
                            block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Run one prefill of `num_tokens` tokens and `num_logits` logit rows, then size the KV cache
    (utilization validated by EngineConfig)."""
    shapes = [(attn.num_kv_heads, attn.head_dim) for attn in model.attention_layers()]
    num_blocks = -(-num_tokens // block_size)
    dense = parse_kv_cache_dtype("auto", dtype)
    cache = KVCache(shapes, dense, dtype, KVCache.bytes_per_token_of(shapes, dense, dtype) * block_size * num_blocks,
                    block_size, device)
    backend.bind_attention(model.attention_layers(), cache.layers)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = _prefill(model, num_tokens, num_blocks, device)
    model.compute_logits(hidden[-num_logits:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    for attn in model.attention_layers():  # let the temporary cache go; the runner binds the real one
        attn.bind(None, None)
    del hidden, cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return kv_cache_budget(utilization, total, total - free, peak, num_tokens)


def _prefill(model: nn.Module, num_tokens: int, num_blocks: int, device: torch.device):
    """One row of `num_tokens` prompt tokens over blocks 0.. of the temporary cache."""
    slots = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(slots, torch.tensor([0, num_tokens], device=device),
                             torch.tensor([num_tokens], device=device),
                             torch.arange(num_blocks, device=device)[None], leading_decodes([num_tokens]), [0, num_tokens],
                             [num_tokens])
    with use_metadata(meta):
        return model(torch.zeros(num_tokens, dtype=torch.long, device=device), slots)
