"""Decode steps through all llama-family decoder layers in one native call (kernels/decoder_layer.c).

At one token per sequence a layer's arithmetic takes microseconds, and the torch path's
Python (module calls, per-kernel ctypes conversions, tensor allocations) cost more than
reading the layer's weights. A `DecodeStack` describes a model's layers to the C code
once (packed weights, norms, KV caches, shapes); each step then costs one call, with a
description of the step (positions, slots, block tables) built once from its metadata.

It serves steps where every token decodes (no prefill chunk), up to the policy's bound on tokens,
in bf16 on the CPU, for models whose every layer has native packed projections (bf16, int8
or int4), no biases, no q/k norms, a SiLU MLP and a dense bf16 KV cache or a calibrated
TurboQuant cache (whose 16-bit window, if any, is staged in bf16; the C code calls the
TurboQuant kernels, and the window's placement is decided here once per step); anything else
returns None and takes the torch path, which stays the reference this one is tested against.
The GEMMs take the kernels the backend's GemmPolicy picks for the step's number of tokens.
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.attention.metadata import get_metadata
from slipstream.attention.turboquant import place_staging
from slipstream.backends.cpu import abi
from slipstream.backends.cpu.attention import has_slack, turboquant_layer, window_tokens
from slipstream.backends.cpu.linear import GemmPolicy
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.recent_window import Staging
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache, native_encoder
from slipstream.layers.linear import Linear


def packed_weight(linear: nn.Module, lib: abi.Kernels) -> abi.Weight | None:
    """The C description of a projection with a native packed weight and no bias, else None."""
    if not isinstance(linear, Linear) or linear.bias is not None or not hasattr(linear.method, "weight_struct"):
        return None
    return linear.method.weight_struct(linear, lib)


def _layer(layer: nn.Module, lib: abi.Kernels) -> tuple[abi.Layer, abi.TurboQuantLayer | None] | None:
    """The C description of a llama decoder layer (input_layernorm, self_attn,
    post_attention_layernorm, gated mlp) bound to its KV cache (and, for a TurboQuant cache, its own
    description, which the layer points to), or None if it does not fit."""
    attn, mlp = layer.self_attn, layer.mlp
    cache = attn.attn.kv_cache
    projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    weights = [packed_weight(m, lib) for m in projections]
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if (None in weights or attn.qk_norm or getattr(mlp, "act", None) is not F.silu
            or any(w.dtype != torch.bfloat16 for w in norms)
            or layer.input_layernorm.eps != layer.post_attention_layernorm.eps):
        return None
    turboquant = _turboquant_layer(attn.attn, cache, lib) if isinstance(cache, TurboQuantLayerCache) else None
    if turboquant is None and not _dense_bf16(cache, attn.attn.num_heads, lib):
        return None
    if turboquant is None:
        heads, num_blocks, block_size, head_dim = cache.k.shape
        k_cache, v_cache = cache.k.data_ptr(), cache.v.data_ptr()
    else:
        (num_blocks, block_size, heads, _), head_dim = cache.k.shape, cache.key_mean.shape[1]
        k_cache = v_cache = None
    return abi.Layer(norms[0].data_ptr(), norms[1].data_ptr(), *weights,
                     None if turboquant is None else ctypes.pointer(turboquant), k_cache, v_cache,
                     num_blocks, attn.attn.sliding_window or 0, block_size, attn.attn.num_heads, heads, head_dim,
                     norms[0].shape[0], weights[2].n // 2, layer.input_layernorm.eps, attn.attn.scale), turboquant


def _dense_bf16(cache, num_heads: int, lib: abi.Kernels) -> bool:
    if not (isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16 and cache.k.device.type == "cpu"):
        return False
    heads, _, block_size, head_dim = cache.k.shape
    return (num_heads // heads <= lib.paged_attention_max_group and head_dim <= lib.paged_attention_max_head_dim
            and block_size <= lib.paged_attention_max_block)


def _turboquant_layer(attention: nn.Module, cache: TurboQuantLayerCache,
                      lib: abi.Kernels) -> abi.TurboQuantLayer | None:
    """A calibrated TurboQuant cache on the CPU, its window (if any) staged in bf16, in shapes the kernel serves."""
    recent = cache.window
    if (not cache.calibrated or cache.k.device.type != "cpu" or not has_slack(cache, lib)
            or recent is not None and recent.k.dtype != torch.bfloat16):
        return None
    heads = cache.k.shape[2]
    described = turboquant_layer(cache, attention.num_heads // heads, attention.scale, attention.sliding_window)
    if lib.turboquant_attention_fits(described):
        return None
    return abi.TurboQuantLayer(
        described, abi.DenseTokens() if recent is None else window_tokens(cache),
        native_encoder(cache.k, cache.key_quantizer, cache.key_mean, cache.key_scale),
        native_encoder(cache.v, cache.value_quantizer), ctypes.cast(lib.turboquant_paged_attention, ctypes.c_void_p),
        ctypes.cast(lib.turboquant_encode, ctypes.c_void_p))


class _Described(NamedTuple):
    """What `DecodeStack.described` built, and from which caches (in which calibration state)."""
    caches: tuple
    calibrated: tuple
    layers: ctypes.Array | None
    turboquant: list  # the TurboQuant descriptions, kept alive beside the array that points to them
    stagings: list[Staging]  # the windows' placements, each once: a step places them before the C code writes


class DecodeStack:
    """A model's decoder layers, run whole for the decode steps the C code serves: the CPU
    backend's fused decode stack. Its description of the layers is built on first use and
    again whenever a KV cache is rebound."""

    def __init__(self, layers: nn.ModuleList, policy: GemmPolicy):
        self.layers, self.policy = layers, policy
        self._built: _Described | None = None

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """Runs every layer on x in place and returns True when the step is one the stack
        serves; False (x untouched) sends it down the torch path."""
        layers = self.described()
        step = None if layers is None else decode_step(positions, x, self.layers[0].self_attn.rotary, self.policy)
        if step is None:
            return False
        for staging in self._built.stagings:  # where the torch path's first TurboQuant layer places them
            place_staging(staging, get_metadata())
        self.run(layers, step, x)
        return True

    def described(self) -> ctypes.Array | None:
        """The layers as `decoder_layers_decode` takes them; None when any does not fit."""
        lib = abi.kernels()
        if lib is None:
            return None
        caches = tuple(layer.self_attn.attn.kv_cache for layer in self.layers)
        calibrated = tuple(getattr(cache, "calibrated", True) for cache in caches)
        built = self._built
        if built is None or calibrated != built.calibrated or any(a is not b for a, b in zip(built.caches, caches)):
            described = [_layer(layer, lib) for layer in self.layers]
            layers = None if None in described else (abi.Layer * len(described))(*(d[0] for d in described))
            windows = (getattr(cache, "window", None) for cache in caches)
            stagings = list({id(w.staging): w.staging for w in windows if w is not None}.values())
            self._built = _Described(caches, calibrated, layers, [d[1] for d in described if d], stagings)
        return self._built.layers

    @staticmethod
    def run(layers: ctypes.Array, step: abi.Step, x: torch.Tensor) -> None:
        if abi.kernels().decoder_layers_decode(layers, len(layers), step, x.data_ptr()) != 0:
            raise MemoryError(f"native decode could not allocate scratch for {x.shape[0]} tokens")


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
        cos, sin = rotary.tables(positions)
        # per weight kind (q4: GGUF's Q4 repacked, on int4's kernels); the C code checks each K
        amx = [policy.amx_serves(fmt, tokens) for fmt in ("bf16", "int8", "int4", "int4")]
        step = abi.Step(tokens, meta.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr(), cos.data_ptr(),
                        sin.data_ptr(), tables.shape[1], abi.threads(), (abi.I32 * 4)(*amx))
        meta.step_cache[key] = (step, tables, lens, cos, sin)  # the tensors stay alive with the step
    return meta.step_cache[key][0]
