"""CudaBackend: Triton kernels where triton is installed, the reference's torch paths elsewhere.

Binds attention over dense caches to one Triton kernel per step, attention on TurboQuant codes
to Triton kernels for decode rows and prefill chunks over a cached prefix (with a Triton
encoder for their writes; backends/cuda/attention.py), MoE experts to grouped Triton GEMMs
(backends/cuda/experts.py); linear layers stay F.linear (cuBLAS). It also sizes the KV cache
for gpu_memory_utilization (memory.py) and captures decode graphs (graphs.py). The kernel
modules import triton, so they are imported on first use, never here: without triton the
backend says so and runs the torch paths.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
from torch import nn

from slipstream.attention import turboquant
from slipstream.backends.base import AttentionImpl
from slipstream.backends.cuda.experts import TritonExperts
from slipstream.backends.cuda.graphs import DecodeGraphs, graph_blockers
from slipstream.backends.reference import ReferenceBackend
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from slipstream.layers.moe import Experts, ExpertsMethod

TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
FP8_MIN_CAPABILITY = (8, 9)  # Triton's float8e4nv needs Ada or Hopper


class CudaBackend(ReferenceBackend):
    name = "cuda"

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.triton = importlib.util.find_spec("triton") is not None

    @property
    def default_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def attention(self, cache) -> AttentionImpl:
        if not self.triton:
            return super().attention(cache)
        from slipstream.backends.cuda import attention

        if isinstance(cache, TurboQuantLayerCache):
            return functools.partial(turboquant.paged_attention, decode_kernel=attention.turboquant_decode,
                                     prefill_kernel=attention.turboquant_prefill)
        if isinstance(cache, LayerKVCache) and self._triton_reads(cache.k.dtype):
            return attention.dense_attention
        return super().attention(cache)

    def experts_method(self, experts: Experts) -> ExpertsMethod:
        return TritonExperts() if self.triton else super().experts_method(experts)

    def kv_cache_memory(self, model: nn.Module, utilization: float, num_tokens: int, num_logits: int,
                        block_size: int, dtype: torch.dtype) -> int:
        from slipstream.backends.cuda.memory import profile_kv_cache_memory

        return profile_kv_cache_memory(model, self, utilization, num_tokens, num_logits, block_size, dtype,
                                       self.device)

    def decode_graphs(self, model: nn.Module, kv_cache, max_num_seqs: int, max_model_len: int) -> DecodeGraphs:
        """Graphs of the decode step, captured now; the last block of `kv_cache` is their scratch block."""
        blockers = graph_blockers(self.device, self.triton, any(kv_cache.turboquant))
        if blockers:
            raise ValueError(f"enforce_eager=False: CUDA graphs cannot run here: {'; '.join(blockers)}")
        max_blocks = min(kv_cache.num_blocks, -(-max_model_len // kv_cache.block_size))
        graphs = DecodeGraphs(max_num_seqs, max_blocks, kv_cache.block_size, max_model_len,
                              scratch_block=kv_cache.num_blocks - 1, device=self.device)
        graphs.capture(model)
        return graphs

    def bind_attention(self, layers: list, caches: list) -> None:
        super().bind_attention(layers, caches)
        if self.triton:
            from slipstream.backends.cuda.attention import turboquant_encode

            for cache in caches:
                if isinstance(cache, TurboQuantLayerCache):
                    cache.encoder = turboquant_encode

    def _triton_reads(self, dtype: torch.dtype) -> bool:
        if dtype == torch.float8_e4m3fn and self.device.type == "cuda":
            return torch.cuda.get_device_capability(self.device) >= FP8_MIN_CAPABILITY
        return dtype in TRITON_DTYPES

    def describe(self) -> list[str]:
        where = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else str(self.device)
        if not self.triton:
            return [f"backend {self.name}: plain torch on {where} (triton is not installed: pip install '.[gpu]')",
                    "attention: torch; linear: F.linear"]
        return [f"backend {self.name}: Triton kernels on {where}",
                ("attention: one Triton kernel per step over dense caches (bf16/fp16/fp32, fp8 from sm89); "
                 "Triton on TurboQuant codes (encoder, decode, prefill over a cached prefix)"),
                "MoE experts: grouped Triton GEMMs (silu, gelu-tanh)", "linear: F.linear"]
