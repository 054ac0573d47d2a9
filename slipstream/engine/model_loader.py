"""load_model: from `model=` to (model on its device and dtype, ModelConfig, tokenizer).

The one place where files meet model code: loader/ reads a GGUF file or a checkpoint
directory into a config dict and named tensors, models/ turns those into a loaded module;
here the weights are then cast and handed to the backend, which lays them out (quantized,
packed) for its GEMMs.

A quantized GGUF file runs as stored (quantization="gguf", vLLM's name for these files): its
blocks are the model's memory and its GEMM's operands, where the backend runs them natively
(`runs_gguf_blocks`: the CPU backend with its kernels; elsewhere the blocks would have only the
torch twin, which dequantizes on every call) and the dtype was left to the engine ("auto").
A dtype asked for (`dtype="bfloat16"`) widens the file's tensors to it, as a file without
blocks always is.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from slipstream.backends.base import Backend
from slipstream.layers.gguf_linear import has_blocks
from slipstream.loader import safetensors
from slipstream.loader.gguf import GGUFFile
from slipstream.loader.hf_config import read_hf_config
from slipstream.loader.registry import resolve_model_path
from slipstream.loader.tokenizer import load_tokenizer
from slipstream.models.config import ModelConfig
from slipstream.models.registry import build_model, config_from_hf


@dataclass
class LoadedModel:
    path: str
    model: nn.Module
    config: ModelConfig
    tokenizer: object | None
    quantization: str | None = None  # the format the weights run in ("gguf": as the file stores them)


def load_model(name: str, dtype: torch.dtype, backend: Backend, quantization: str | None = None,
               widen: bool = False, skip_tokenizer: bool = False) -> LoadedModel:
    """widen: a quantized GGUF file's tensors dequantized to `dtype` unless quantization="gguf" asks
    for its blocks (a dtype was named); else they run as stored where the backend runs them natively.
    skip_tokenizer: none is loaded (the engine then takes token ids only)."""
    device = backend.device
    if quantization and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on PyTorch's CPU kernels; "
                         f"device={device.type!r} is not supported (use device='cpu' or no quantization)")
    path = resolve_model_path(name)
    cfg, weights, quantization = _read(path, backend, quantization, widen)  # headers only: weights are read below
    # before the weights: the tokenizer's transient memory (Gemma 3's: ~730 MiB) never meets them
    tokenizer = None if skip_tokenizer else load_tokenizer(path)
    config = config_from_hf(cfg)
    with _uninitialized():
        model = build_model(config)
    model.load_weights(weights)  # read to the end, the iterator lets its file go
    _cast(model, dtype)
    model.to(device)
    backend.prepare(model, quantization)
    model.eval()
    _add_tokenizer_eos(config, tokenizer)
    return LoadedModel(path, model, config, tokenizer, quantization)


def _read(path: str, backend: Backend, quantization: str | None, widen: bool):
    """(HF config dict, named tensors, the quantization the weights run in) of a GGUF file or a checkpoint."""
    if path.endswith(".gguf"):
        gguf = GGUFFile(path)
        if quantization is None and not widen and backend.runs_gguf_blocks and gguf.is_quantized():
            quantization = "gguf"
        if quantization == "gguf" and not gguf.is_quantized():
            raise ValueError(f"quantization='gguf' runs a GGUF file's blocks; {path!r} holds no block format")
        return gguf.hf_config(), gguf.hf_weights(as_stored=quantization == "gguf"), quantization
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' runs a GGUF file's blocks; {path!r} is not a .gguf file")
    return read_hf_config(path), safetensors.hf_weights(path), quantization


@contextmanager
def _uninitialized():
    """Parameters left as allocated while a model is built: every one is then loaded (a missing tensor
    is an error), and random init would write every page of float32 placeholders that a GGUF file's
    blocks replace unread (SmolLM2: 540 MB). transformers skips it the same way."""
    saved = {name: getattr(nn.init, name) for name in ("kaiming_uniform_", "uniform_", "normal_")}
    for name in saved:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def _cast(model: nn.Module, dtype: torch.dtype) -> None:
    """Parameters to `dtype`; buffers (rotary frequencies, GGUF blocks) stay as they are, and the
    modules holding blocks learn the dtype their activations run in."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    for module in model.modules():
        if has_blocks(module):
            module.dtype = dtype


def _add_tokenizer_eos(config: ModelConfig, tokenizer) -> None:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and eos not in config.eos_token_ids:
        config.eos_token_ids.append(eos)
