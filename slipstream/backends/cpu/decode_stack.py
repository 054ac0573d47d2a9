"""Decode steps through all llama-family or Gemma 3 decoder layers and the final norm in one native call
(kernels/decoder_layer.c).

At one token per sequence a layer's arithmetic takes microseconds, and the torch path's
Python (module calls, per-kernel ctypes conversions, tensor allocations) cost more than
reading the layer's weights. A `DecodeStack` describes a model's layers to the C code
once (packed weights, norms, KV caches, shapes); each step then costs one call, with a
description of the step (positions, slots, block tables) built once from its metadata.

It serves steps where every token decodes (no prefill chunk), up to the policy's bound on tokens,
in bf16 on the CPU, for models whose every layer has native packed projections (bf16, int8,
int4, or a GGUF's blocks as stored, a projection fused from two formats included), no biases,
per-head q/k norms or none, norms all of one form (llama's, or Gemma 3's unit offset, its norms
of each block's output included), a SiLU or GELU-tanh MLP, at most two rotary bases (Gemma's
local and global) and a dense bf16 KV cache or a calibrated TurboQuant cache (the C code calls
the TurboQuant kernels as the per-layer path's decode steps do, and the window's placement is
decided here once per step); anything else returns None and takes the torch path,
which stays the reference this one is tested against. The GEMMs take the kernels the backend's
GemmPolicy picks for the step's number of tokens (Q8_0 has one, the AVX-512 loops).
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.attention.metadata import AttentionMetadata, get_metadata
from slipstream.attention.turboquant import place_staging
from slipstream.backends.cpu import abi
from slipstream.backends.cpu.attention import turboquant_decode_layer
from slipstream.backends.cpu.linear import GemmPolicy
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.recent_window import Staging
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from slipstream.layers.linear import Linear
from slipstream.layers.mlp import gelu_tanh


def packed_weight(linear: nn.Module, lib: abi.Kernels) -> abi.Weight | None:
    """The C description of a projection with a native packed weight and no bias, else None."""
    if not isinstance(linear, Linear) or linear.bias is not None or not hasattr(linear.method, "weight_struct"):
        return None
    return linear.method.weight_struct(linear, lib)


def _norms(layer: nn.Module) -> list[nn.Module | None]:
    """The layer's norms in decoder_layer.c's order: before attention, before the MLP, of the attention's
    and the MLP's outputs (Gemma 3's sandwich; None in llama's layer), of each q and k head (or None)."""
    attn = layer.self_attn
    heads = [attn.q_norm, attn.k_norm] if attn.qk_norm == "head" else [None, None]
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma 3: post_attention_layernorm is of the output
        return [layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
                layer.post_feedforward_layernorm, *heads]
    return [layer.input_layernorm, layer.post_attention_layernorm, None, None, *heads]


def _layer(layer: nn.Module, lib: abi.Kernels, rope: int) -> tuple[abi.Layer, abi.TurboQuantLayer | None] | None:
    """The C description of a llama or Gemma 3 decoder layer bound to its KV cache (and, for a TurboQuant cache,
    its own description, which the layer points to), or None if it does not fit."""
    attn, mlp = layer.self_attn, layer.mlp
    cache = attn.attn.kv_cache
    projections = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    weights = [packed_weight(m, lib) for m in projections]
    norms = _norms(layer)
    present = [n for n in norms if n is not None]
    forms = {_form(n) for n in present}  # one form, llama's or Gemma 3's
    if (None in weights or rope > 1 or attn.qk_norm not in (None, "head") or attn.clip_qkv is not None
            or getattr(mlp, "act", None) not in (F.silu, gelu_tanh) or len(forms) > 1
            or present[0].cast_last != present[0].unit_offset or present[0].weight.dtype != torch.bfloat16):
        return None
    turboquant = None
    if isinstance(cache, TurboQuantLayerCache):
        group = attn.attn.num_heads // cache.k.shape[2]
        turboquant = turboquant_decode_layer(cache, group, attn.attn.scale, attn.attn.sliding_window, lib)
    if turboquant is None and not _dense_bf16(cache, attn.attn.num_heads, lib):
        return None
    if turboquant is None:
        heads, num_blocks, block_size, head_dim = cache.k.shape
        k_cache, v_cache = cache.k.data_ptr(), cache.v.data_ptr()
    else:
        (num_blocks, block_size, heads, _), head_dim = cache.k.shape, cache.key_mean.shape[1]
        k_cache = v_cache = None
    return abi.Layer(*(None if n is None else n.weight.data_ptr() for n in norms), *weights,
                     None if turboquant is None else ctypes.pointer(turboquant), k_cache, v_cache,
                     num_blocks, attn.attn.sliding_window or 0, block_size, attn.attn.num_heads, heads, head_dim,
                     present[0].weight.shape[0], weights[2].n // 2, present[0].unit_offset, mlp.act is gelu_tanh, rope,
                     present[0].eps, attn.attn.scale), turboquant


def _form(norm: nn.Module) -> tuple:
    return norm.eps, norm.unit_offset, norm.cast_last, norm.weight.dtype


def _dense_bf16(cache, num_heads: int, lib: abi.Kernels) -> bool:
    if not (isinstance(cache, LayerKVCache) and cache.k.dtype == torch.bfloat16 and cache.k.device.type == "cpu"):
        return False
    heads, _, block_size, head_dim = cache.k.shape
    return (num_heads // heads <= lib.paged_attention_max_group and head_dim <= lib.paged_attention_max_head_dim
            and block_size <= lib.paged_attention_max_block)


class _Described(NamedTuple):
    """What `DecodeStack.described` built, and from which caches (in which calibration state)."""
    caches: list
    calibrated: list
    layers: ctypes.Array | None
    turboquant: list  # the TurboQuant descriptions, kept alive beside the array that points to them
    stagings: list[Staging]  # the windows' placements, each once: a step places them before the C code writes


class DecodeStack:
    """A model's decoder layers and final norm, run whole for the decode steps the C code serves:
    the CPU backend's fused decode stack. Its description of the layers is built on first use
    and again whenever a KV cache is rebound."""

    def __init__(self, layers: nn.ModuleList, norm: nn.Module, policy: GemmPolicy):
        self.layers, self.norm, self.policy = layers, norm, policy
        self.rotaries = list({id(layer.self_attn.rotary): layer.self_attn.rotary for layer in layers}.values())
        self.rotations, self.step = RotaryTables(self.rotaries), abi.Step()
        # the Attention modules whose caches the description binds, found once: reaching them through
        # nn.Module's attribute lookup every step cost ~60 us of a ~5 ms SmolLM2 step
        self.attentions = [layer.self_attn.attn for layer in layers]
        self._built: _Described | None = None

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        """Runs every layer and the final norm on x in place and returns True when the step is
        one the stack serves; False (x untouched) sends it down the torch path."""
        layers, meta = self.described(), get_metadata()
        if layers is None or not self._serves(meta, x):
            return False
        for staging in self._built.stagings:  # where the torch path's first TurboQuant layer places them
            place_staging(staging, meta)
        self.run(layers, self._step(meta, positions, x.shape[0]), x)
        return True

    def _serves(self, meta: AttentionMetadata, x: torch.Tensor) -> bool:
        """Every row of x is a decode token, in bf16 on the CPU, below the policy's bound on tokens."""
        tokens, most = x.shape[0], self.policy.decode_stack_max_tokens()
        return not (meta.prefills or meta.num_decodes != tokens or most is not None and tokens >= most
                    or x.dtype != torch.bfloat16 or x.device.type != "cpu" or not x.is_contiguous()
                    or torch.is_grad_enabled())

    def _step(self, meta: AttentionMetadata, positions: torch.Tensor, tokens: int) -> abi.Step:
        """The step's C description: one struct, refilled (building one cost ~20 us a step)."""
        step = self.step
        if step.tokens != tokens:  # the kernel per weight kind (blocks: int4's; q8: int8's, its AMX = loops)
            step.kernel[:] = [self.policy.stack_kernel(fmt, tokens) for fmt in ("bf16", "int8", "int4", "int8")]
        self.rotations.place(step, max(meta.context_lens) - 1)
        # every row decodes: the whole block table and seq_lens are the decode rows'
        step.tokens, step.slots, step.positions = tokens, meta.slot_mapping.data_ptr(), positions.data_ptr()
        step.block_tables, step.context_lens = meta.block_table.data_ptr(), meta.seq_lens.data_ptr()
        step.max_blocks, step.threads = meta.block_table.shape[1], abi.threads()
        return step

    def described(self) -> ctypes.Array | None:
        """The layers as `decoder_layers_decode` takes them; None when any does not fit."""
        lib = abi.kernels()
        if lib is None:
            return None
        caches = [attention.kv_cache for attention in self.attentions]
        calibrated = [getattr(cache, "calibrated", True) for cache in caches]
        built = self._built
        if built is None or calibrated != built.calibrated or any(a is not b for a, b in zip(built.caches, caches)):
            ropes = [self.rotaries.index(layer.self_attn.rotary) for layer in self.layers]
            described = [_layer(layer, lib, rope) for layer, rope in zip(self.layers, ropes)]
            fits = None not in described and _form(self.norm) == _form(self.layers[0].input_layernorm)
            layers = (abi.Layer * len(described))(*(d[0] for d in described)) if fits else None
            windows = (getattr(cache, "window", None) for cache in caches)
            stagings = list({id(w.staging): w.staging for w in windows if w is not None}.values())
            self._built = _Described(caches, calibrated, layers, [d[1] for d in described if d], stagings)
        return self._built.layers

    def run(self, layers: ctypes.Array, step: abi.Step, x: torch.Tensor) -> None:
        if abi.kernels().decoder_layers_decode(layers, len(layers), self.norm.weight.data_ptr(), step, x.data_ptr()):
            raise MemoryError(f"native decode could not allocate scratch for {x.shape[0]} tokens")


class RotaryTables:
    """cos and sin of every position below a bound, per rotary base, which the C code reads by each
    token's position: a step computes none (the four torch ops of `RotaryEmbedding.tables` cost
    ~50 us of a SmolLM2 step, on caches the weights have just streamed through). Their rows are
    those tables' rows bit for bit (an elementwise function of the position). Grown by doubling
    to the longest context served: SmolLM2 at 8k holds 2 MB, Gemma 3's two bases at 32k 64 MB."""

    def __init__(self, rotaries: list[nn.Module]):
        self.rotaries, self.covered, self.tables = rotaries, 0, []

    def covering(self, last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [covered, head_dim / 2] float32 per base, covering positions [0, last]."""
        if last >= self.covered:
            self.covered = max(1024, 1 << last.bit_length())
            positions = torch.arange(self.covered, device=self.rotaries[0].inv_freq.device)
            self.tables = [rotary.tables(positions) for rotary in self.rotaries]
        return self.tables

    def place(self, step: abi.Step, last: int) -> None:
        """Points the step at tables covering positions [0, last]."""
        for i, (cos, sin) in enumerate(self.covering(last)):
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
