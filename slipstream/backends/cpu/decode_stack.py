"""Decode steps through all llama-family decoder layers in one native call (kernels/decoder_layer.c).

At one token per sequence a layer's arithmetic takes microseconds, and the torch path's
Python (module calls, per-kernel ctypes conversions, tensor allocations) cost more than
reading the layer's weights. A `DecodeStack` describes a model's layers to the C code
once (packed weights, norms, KV caches, shapes); each step then costs one call, with a
description of the step (positions, slots, block tables) built once from its metadata.

It serves steps where every token decodes (no prefill chunk), up to the policy's bound on tokens,
in bf16 on the CPU, for models whose every layer has native packed projections (bf16, int8
or int4), no biases, no q/k norms, a SiLU MLP and a dense bf16 KV cache; anything else
returns None and takes the torch path, which stays the reference this one is tested against.
The GEMMs take the kernels the backend's GemmPolicy picks for the step's number of tokens.
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.attention.metadata import get_metadata
from slipstream.backends.cpu import abi
from slipstream.backends.cpu.linear import GemmPolicy
from slipstream.kvcache.cache import LayerKVCache
from slipstream.layers.linear import Linear


def packed_weight(linear: nn.Module, lib: abi.Kernels) -> abi.Weight | None:
    """The C description of a projection with a native packed weight and no bias, else None."""
    if not isinstance(linear, Linear) or linear.bias is not None or not hasattr(linear.method, "weight_struct"):
        return None
    return linear.method.weight_struct(linear, lib)


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


class DecodeStack:
    """A model's decoder layers, run whole for the decode steps the C code serves: the CPU
    backend's fused decode stack. Its description of the layers is built on first use and
    again whenever a KV cache is rebound."""

    def __init__(self, layers: nn.ModuleList, policy: GemmPolicy):
        self.layers, self.policy = layers, policy
        self._built: tuple[tuple, ctypes.Array | None] | None = None

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """Runs every layer on x in place and returns True when the step is one the stack
        serves; False (x untouched) sends it down the torch path."""
        layers = self.described()
        step = None if layers is None else decode_step(positions, x, self.layers[0].self_attn.rotary, self.policy)
        if step is None:
            return False
        self.run(layers, step, x)
        return True

    def described(self) -> ctypes.Array | None:
        """The layers as `decoder_layers_decode` takes them; None when any does not fit."""
        lib = abi.kernels()
        if lib is None:
            return None
        caches = tuple(layer.self_attn.attn.kv_cache for layer in self.layers)
        if self._built is None or any(a is not b for a, b in zip(self._built[0], caches)):
            structs = [_layer(layer, lib) for layer in self.layers]
            self._built = (caches, None if None in structs else (abi.Layer * len(structs))(*structs))
        return self._built[1]

    @staticmethod
    def run(layers: ctypes.Array, step: abi.Step, x: torch.Tensor) -> None:
        if abi.kernels().decoder_layers_decode(layers, len(layers), step, x.data_ptr()) != 0:
            raise MemoryError(f"native decode could not allocate scratch for {x.shape[0]} tokens")


def _dense_bf16(cache) -> bool:
    return isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16 and cache.k.device.type == "cpu"


def decode_step(positions: torch.Tensor, x: torch.Tensor, rotary: nn.Module, policy: GemmPolicy) -> abi.Step | None:
    """The step's shared C description when every row of x is a decode token, else None;
    built once per step and kept in the metadata's step cache."""
    meta, tokens, most = get_metadata(), x.shape[0], policy.decode_stack_max_tokens()
    if (meta.prefills or meta.num_decodes != tokens or most is not None and tokens >= most or x.dtype != torch.bfloat16
            or x.device.type != "cpu" or not x.is_contiguous() or torch.is_grad_enabled()):
        return None
    key = "native decode step"
    if key not in meta.step_cache:
        tables, lens = meta.decode_block_tables.contiguous(), meta.decode_context_lens.contiguous()
        positions = positions.contiguous()
        amx = [policy.amx_serves(fmt, tokens) for fmt in ("bf16", "int8", "int4")]  # the C code checks each K
        step = abi.Step(tokens, positions.data_ptr(), meta.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                        rotary.cos.data_ptr(), rotary.sin.data_ptr(), tables.shape[1], abi.threads(), (abi.I32 * 3)(*amx))
        meta.step_cache[key] = (step, tables, lens, positions)  # the tensors stay alive with the step
    return meta.step_cache[key][0]
