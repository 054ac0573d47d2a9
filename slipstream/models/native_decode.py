"""Decode steps through all llama-family decoder layers in one native call (kernels/decoder_layer.c).

At one token per sequence a layer's arithmetic takes microseconds, and the torch path's
Python (module calls, per-kernel ctypes conversions, tensor allocations) cost more than
reading the layer's weights. A `NativeDecoder` describes a model's layers to the C code
once (packed weights, norms, KV caches, shapes); each step then costs one call, with a
description of the step (positions, slots, block tables) built once from its metadata.

It serves steps where every token decodes (no prefill chunk), below `max_tokens()` tokens,
in bf16 on the CPU, for models whose every layer has native packed projections (bf16, int8
or int4), no biases, no q/k norms, a SiLU MLP and a dense bf16 KV cache; anything else
returns None and takes the torch path, which stays the reference this one is tested against.
The GEMMs take the kernels layers/linear.py's policy picks for the step's number of tokens.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.attention.metadata import get_metadata
from slipstream.backends.cpu import abi
from slipstream.kvcache.cache import LayerKVCache
from slipstream.layers.linear import UPCAST_MIN_ROWS, Linear, amx_gemm_available, amx_serves
from slipstream.layers.quantization import Int4Linear, Int8Linear


def packed_weight(linear: nn.Module, lib: abi.Kernels) -> abi.Weight | None:
    """The C description of a projection with a native packed weight and no bias, else None."""
    if getattr(linear, "bias", None) is not None or getattr(linear, "packed", None) is None:
        return None
    if isinstance(linear, Linear) and linear.native:
        return abi.Weight(lib.weight_kind_bf16, linear.packed.data_ptr(), None, None, linear.out_features)
    if isinstance(linear, Int8Linear):
        return abi.Weight(lib.weight_kind_int8, linear.packed.data_ptr(), linear.scale_f32.data_ptr(), None,
                          linear.qweight.shape[0])
    if isinstance(linear, Int4Linear):
        return abi.Weight(lib.weight_kind_int4, linear.packed.data_ptr(), linear.packed_scale.data_ptr(),
                          linear.packed_low.data_ptr(), linear.packed.shape[0] * 16)
    return None


def _layer(layer: nn.Module, lib: abi.Kernels) -> abi.Layer | None:
    """The C description of a llama decoder layer (input_layernorm, self_attn,
    post_attention_layernorm, gated mlp) bound to its KV cache, or None if it does not fit."""
    attn, mlp = layer.self_attn, layer.mlp
    cache = attn.attn.kv_cache
    projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    weights = [packed_weight(m, lib) for m in projections]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if (None in weights or attn.qk_norm or getattr(mlp, "act", None) is not F.silu or not _dense_bf16(cache)
            or any(w.dtype != torch.bfloat16 for w in norms) or attn.rotary.cos.dtype != torch.float32
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
        return None
    heads, num_blocks, block_size, head_dim = cache.k.shape
    if (attn.attn.num_heads // heads > lib.paged_attention_max_group or head_dim > lib.paged_attention_max_head_dim
            or block_size > lib.paged_attention_max_block):
        return None
    return abi.Layer(norms[0].data_ptr(), norms[1].data_ptr(), *weights, cache.k.data_ptr(), cache.v.data_ptr(),
                  num_blocks, attn.attn.sliding_window or 0, block_size, attn.attn.num_heads, heads, head_dim,
                  norms[0].shape[0], weights[2].n // 2, layer.input_layernorm.eps, attn.attn.scale)


class NativeDecoder:
    """A model's decoder layers described to `decoder_layers_decode` once."""

    def __init__(self, layers: ctypes.Array):
        self.layers = layers

    @classmethod
    def of(cls, layers: nn.ModuleList) -> NativeDecoder | None:
        """The native form of `layers`, built on first use and again whenever a KV cache is
        rebound; None when the kernel is unavailable or any layer does not fit."""
        lib = abi.kernels()
        if lib is None:
            return None
        caches = tuple(layer.self_attn.attn.kv_cache for layer in layers)
        built = getattr(layers, "_native_decode", None)
        if built is None or any(a is not b for a, b in zip(built[0], caches)):
            structs = [_layer(layer, lib) for layer in layers]
            native = None if None in structs else cls((abi.Layer * len(structs))(*structs))
            built = layers._native_decode = (caches, native)
        return built[1]

    def __call__(self, x: torch.Tensor, step: abi.Step) -> None:
        """Runs every layer on the contiguous decode rows x, in place."""
        if abi.kernels().decoder_layers_decode(self.layers, len(self.layers), step, x.data_ptr()) != 0:
            raise MemoryError(f"native decode could not allocate scratch for {x.shape[0]} tokens")


def _dense_bf16(cache) -> bool:
    return isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16 and cache.k.device.type == "cpu"


def max_tokens() -> int:
    """Decode batches from this many tokens take the torch path: without AMX the AVX-512 GEMMs
    lose to the fp32 upcast there (layers/linear.py); the AMX kernels serve every size."""
    return 1 << 62 if amx_gemm_available() else UPCAST_MIN_ROWS


def decode_step(positions: torch.Tensor, x: torch.Tensor, rotary: nn.Module) -> abi.Step | None:
    """The step's shared C description when every row of x is a decode token, else None;
    built once per step and kept in the metadata's step cache."""
    meta, tokens = get_metadata(), x.shape[0]
    if (meta.prefills or meta.num_decodes != tokens or tokens >= max_tokens() or x.dtype != torch.bfloat16
            or x.device.type != "cpu" or not x.is_contiguous() or torch.is_grad_enabled()):
        return None
    key = "native decode step"
    if key not in meta.step_cache:
        tables, lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
        positions = positions.contiguous()
        amx = [amx_serves(fmt, tokens) for fmt in ("bf16", "int8", "int4")]  # the C code checks each K
        step = abi.Step(tokens, positions.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                        rotary.cos.data_ptr(), rotary.sin.data_ptr(), tables.shape[1], abi.threads(), (abi.I32 * 3)(*amx))
        meta.step_cache[key] = (step, tables, lens, positions)  # the tensors stay alive with the step
    return meta.step_cache[key][0]
