"""Engine configuration: what a user chooses, validated once at start-up.

`EngineConfig` holds dtype, cache size and batching limits (the architecture is the
model's own `models/config.py`). Keyword arguments of `LLM(...)` are matched against its
fields, so a typo is an error, not a silent no-op.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from slipstream.speculative.config import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "gguf")


@dataclass
class EngineConfig:
    """What a user chooses; defaults fit a laptop."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    # "int8" / "int4" weight-only, "w8a8" int8 weights and activations, "gguf" a GGUF file's blocks
    # as stored (CPU); None: weights as loaded: a quantized GGUF file's as stored where the backend runs
    # its blocks natively and dtype is "auto", else dequantized to the model dtype
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    kv_cache_dense_layers: int = 0  # TurboQuant: first and last N layers keep a 16-bit cache
    # TurboQuant: the newest R and the first S tokens (attention sinks) of each sequence also kept in
    # 16 bits; None: the kv_cache_dtype name's defaults (64 to 144, and 4; none for a "-codes" name)
    kv_cache_recent_tokens: int | None = None
    kv_cache_sink_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 512 * 1024**2
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    device: str = "auto"
    seed: int = 0
    log_stats_interval: float | None = None
    # speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": ...,
    # "prompt_lookup_max": ...} or {"method": "draft_model", "model": ..., "num_speculative_tokens": k,
    # "quantization": ...}; validate() turns it into a SpeculativeConfig
    speculative_config: dict | SpeculativeConfig | None = None
    # batch-invariant outputs (the same bits whatever else is in the batch): True requires them,
    # False takes the fastest kernels, None (auto) has them where they cost nothing (CPUs without AMX)
    deterministic: bool | None = None
    # CUDA: a fraction of the GPU's memory for weights, activations and KV cache together (vLLM's name);
    # when set, the KV cache gets what a profiled forward pass leaves, in place of kv_cache_memory
    gpu_memory_utilization: float | None = None
    # CUDA: False captures decode steps as CUDA graphs (vLLM's name, default True here: no GPU run has
    # shown the graphs correct yet)
    enforce_eager: bool = True
    # no tokenizer (vLLM's name): prompts must be token ids and outputs carry no text; saves its load
    # time and memory (a GGUF file's tokenizer is converted from the file: Gemma 3's takes ~14 s, ~730 MiB)
    skip_tokenizer_init: bool = False
    # ranks that split every layer (vLLM's name): this process and N-1 it spawns, or torchrun's N processes
    tensor_parallel_size: int = 1
    # with tensor_parallel_size > 1: MoE experts split by expert (E/N whole experts per rank) instead of
    # every expert split by its features (vLLM's name)
    enable_expert_parallel: bool = False

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    @property
    def max_num_rows(self) -> int:
        """Rows of one step's input batch: one per sequence, or 1 + k for one that verifies k drafts
        (worker/model_runner.py splits it into single-token rows)."""
        return min(self.max_num_batched_tokens, self.max_num_seqs * (1 + self.num_speculative_tokens))

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; allowed: {sorted(known)}")
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype={self.dtype!r} is not supported; allowed: 'auto', {', '.join(map(repr, DTYPES))}")
        if self.quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"quantization={self.quantization!r} is not supported; "
                             f"allowed: None, {', '.join(map(repr, QUANTIZATION_METHODS))}")
        for name in ("block_size", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        for name in ("kv_cache_dense_layers", "kv_cache_recent_tokens", "kv_cache_sink_tokens"):
            value, optional = getattr(self, name), name != "kv_cache_dense_layers"
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer"
                                 + (" or None (the kv_cache_dtype's default)" if optional else ""))
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer or None")
        if not (self.deterministic is None or isinstance(self.deterministic, bool)):
            raise ValueError(f"deterministic={self.deterministic!r} must be True, False or None (auto)")
        if self.gpu_memory_utilization is not None and (
                isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be None or a fraction in (0, 1]")
        for name in ("enforce_eager", "skip_tokenizer_init"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        draft_quantization = getattr(self.speculative_config, "quantization", None)
        if draft_quantization not in (None, *QUANTIZATION_METHODS):
            raise ValueError(f"speculative_config: quantization={draft_quantization!r} is not supported; "
                             f"allowed: None, {', '.join(map(repr, QUANTIZATION_METHODS))}")
        self._validate_tensor_parallel()

    def _validate_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size={size!r} must be a positive integer")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel={self.enable_expert_parallel!r} must be True or False")
        if self.enable_expert_parallel and size == 1:
            raise ValueError("enable_expert_parallel=True splits experts over ranks: it needs tensor_parallel_size > 1")
        if size == 1:
            return
        if not self.enforce_eager:
            raise ValueError(f"tensor_parallel_size={size} does not capture CUDA graphs; keep enforce_eager=True")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError(f"tensor_parallel_size={size} does not run a draft model; use method 'ngram' "
                             "or tensor_parallel_size=1")
