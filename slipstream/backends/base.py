"""Backend: what serves each layer on this machine, bound once after the model is loaded.

A backend binds an implementation to every layer that has a choice: each `Linear` gets a
linear method (its weight layout and GEMM, for the layer's quantization), each `Attention`
an attention implementation for its cache's dtype, each `Experts` block an expert method;
the model runner asks it for a fused decode stack. Model files never name a backend, and a
backend never knows a model family beyond what its fused decode stack describes.

`describe()` says what was chosen and why (CPU flags, kernels built or not); the engine logs
it at start-up and `slipstream info` prints it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from slipstream.layers.linear import Linear, LinearMethod
from slipstream.layers.moe import Experts, ExpertsMethod
from slipstream.layers.quantization import quantization_of

# attention(q, k, v, cache, metadata, scale, sliding_window) -> out
AttentionImpl = Callable[..., torch.Tensor]


class Backend:
    name = "backend"
    # Whether a bf16 (int8, int4) dense model's outputs on a bf16 KV cache are the same bits
    # whatever else shares the step, however a prompt is chunked, cached or recomputed: one
    # kernel and one reduction order per token. Library GEMMs and SDPA block by shape: no.
    batch_invariant = False
    # Whether a GGUF file's blocks run natively here (not dequantized on every call): a quantized GGUF
    # then loads as stored by default (engine/model_loader.py).
    runs_gguf_blocks = False

    def __init__(self, device: torch.device):
        self.device = device

    @property
    def default_dtype(self) -> torch.dtype:
        """The model dtype that dtype='auto' means here."""
        return torch.float32

    # --- what a backend provides ---------------------------------------------------------
    def linear_method(self, layer: Linear, fmt: str | None) -> LinearMethod:
        """The method for a loaded layer whose weight format is `fmt` (None: as loaded, or a
        quantization in QUANTIZATION_METHODS)."""
        raise NotImplementedError

    def attention(self, cache) -> AttentionImpl:
        raise NotImplementedError

    def experts_method(self, experts: Experts) -> ExpertsMethod:
        raise NotImplementedError

    def decode_stack(self, model: nn.Module):
        """A callable (positions, x) -> bool running all of `model`'s decoder layers in one go
        for the steps it serves (True), or None where the backend has none."""
        return None

    def kv_cache_memory(self, model: nn.Module, utilization: float, num_tokens: int, num_logits: int,
                        block_size: int, dtype: torch.dtype) -> int:
        """gpu_memory_utilization: KV-cache bytes after profiling a forward pass; devices without one refuse."""
        raise ValueError(f"gpu_memory_utilization applies to CUDA devices; this engine runs on {self.device} "
                         f"(set kv_cache_memory instead)")

    def decode_graphs(self, model: nn.Module, kv_cache, max_num_seqs: int, max_model_len: int):
        """enforce_eager=False: captured decode graphs for the model runner; backends without them refuse."""
        raise ValueError(f"enforce_eager=False needs CUDA graphs, which only the cuda backend has; this engine "
                         f"runs the {self.name} backend on {self.device}")

    def invariance_gaps(self, model: nn.Module) -> list[str]:
        """Where batch_invariant holds: the layers of `model` it does not cover, named."""
        return []

    def describe(self) -> list[str]:
        """Lines saying which implementation serves what, and why."""
        return [self.name]

    # --- binding ---------------------------------------------------------------------------
    def prepare(self, model: nn.Module, quantization: str | None) -> None:
        """Bind every Linear and Experts block of a loaded model (on its device) to its method."""
        for name, module in list(model.named_modules()):  # a method may add (and bind) modules of its own
            if isinstance(module, Linear):
                module.bind(self.linear_method(module, quantization_of(name, module, quantization)))
            elif isinstance(module, Experts):
                module.method = self.experts_method(module)

    def bind_attention(self, layers: list[nn.Module], caches: list) -> None:
        for attn, cache in zip(layers, caches, strict=True):
            attn.bind(cache, self.attention(cache))

