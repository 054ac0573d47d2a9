"""Worker: what every rank builds from an EngineConfig before the first step.

The device and dtype, the backend, the rank's shard of the model (all of it with one rank),
and the KV cache for the rank's attention heads, bound to the attention layers. The engine
(rank 0) adds the scheduler, the sampler and the API on top; a tensor-parallel worker
(worker/tp_worker.py) adds only its loop. This module never knows requests.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.backends.base import Backend
from slipstream.backends.select import select_backend
from slipstream.config import EngineConfig
from slipstream.distributed.parallel_state import agree
from slipstream.engine.model_loader import LoadedModel, load_model
from slipstream.kvcache.cache import KVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype
from slipstream.platform import resolve_device, resolve_dtype


@dataclass
class Worker:
    device: torch.device
    dtype: torch.dtype
    backend: Backend
    loaded: LoadedModel
    kv_cache: KVCache
    max_model_len: int  # the config's, capped at the model's positions


def build_worker(config: EngineConfig, kv_cache_tokens: int | None = None) -> Worker:
    """kv_cache_tokens: a cache of that many tokens in place of kv_cache_memory (a draft model's)."""
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    backend = select_backend(device, config.deterministic)
    dtype = resolve_dtype(config.dtype, backend)
    loaded = load_model(config.model, dtype, backend, config.quantization, widen=config.dtype != "auto",
                        skip_tokenizer=config.skip_tokenizer_init)
    positions = loaded.config.max_position_embeddings
    max_model_len = min(config.max_model_len or positions, positions)
    kv_cache = _allocate_kv_cache(config, loaded, backend, dtype, kv_cache_tokens, max_model_len)
    backend.bind_attention(loaded.model.attention_layers(), kv_cache.layers)
    return Worker(device, dtype, backend, loaded, kv_cache, max_model_len)


def _allocate_kv_cache(c: EngineConfig, loaded: LoadedModel, backend: Backend, dtype: torch.dtype,
                       tokens: int | None, max_model_len: int) -> KVCache:
    kv_dtype = parse_kv_cache_dtype(c.kv_cache_dtype, dtype)
    layers = loaded.model.attention_layers()
    shapes = [(attn.num_kv_heads, attn.head_dim) for attn in layers]
    # how far each layer's keys turn over the positions served (TurboQuant calibration: turboquant_cache.py)
    turns = [None if attn.key_rotation is None else attn.key_rotation * max_model_len for attn in layers]
    value_weights = loaded.model.value_weights(dtype, backend.device) if kv_dtype.is_turboquant else None
    memory = c.kv_cache_memory
    if tokens is not None:
        memory = tokens * KVCache.bytes_per_token_of(shapes, kv_dtype, dtype, c.kv_cache_dense_layers)
    if c.gpu_memory_utilization is not None:
        longest = min(c.max_num_batched_tokens, c.max_model_len or loaded.config.max_position_embeddings)
        memory = backend.kv_cache_memory(loaded.model, c.gpu_memory_utilization, longest, c.max_num_seqs,
                                         c.block_size, dtype)
    heads = sum(h for h, _ in shapes)  # tensor parallel: a rank with fewer KV heads needs less for the same blocks
    cache = KVCache(shapes, kv_dtype, dtype, memory * heads // agree(heads, "max"), c.block_size, backend.device,
                    c.kv_cache_dense_layers, c.kv_cache_recent_tokens, c.max_num_seqs, c.kv_cache_sink_tokens, turns,
                    [attn.sliding_window for attn in layers], value_weights)
    cache.num_blocks = agree(cache.num_blocks, "min")  # every rank's block table indexes the same blocks
    return cache
