"""The llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), SmolLM2.

Reads like the paper: embedding, N x (norm -> attention -> residual, norm -> gated MLP ->
residual), final norm, LM head. MHA, GQA and MQA differ only in `num_key_value_heads`.
Q/K/V and gate/up projections are fused into one matmul each (models/weights.py stacks the
checkpoint's separate tensors into them).

`LlamaAttention` and `DecoderLayer` serve the relatives too: Mixtral and the MoE families
are this model with another `mlp()`, Gemma 3 (sandwich norms, its own layer) passes its
attention scale, windows and norm form.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from slipstream.distributed.parallel_state import tp_rank, tp_size
from slipstream.layers.attention import Attention
from slipstream.layers.embedding import VocabParallelEmbedding
from slipstream.layers.linear import ColumnParallelLinear, RowParallelLinear
from slipstream.layers.mlp import GatedMLP
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.models.causal_lm import CausalLM
from slipstream.models.config import ModelConfig, UnsupportedModelError, common_fields


class LlamaAttention(nn.Module):
    """Self-attention of the llama family and its relatives: fused q/k/v projection, heads,
    optional q/k RMSNorm, rotary embedding, paged attention, output projection.

    `config.qk_norm` is "head" (one norm per head: Qwen3, Gemma 3) or "projection" (over all
    heads together, before the split: OLMoE), and `config.clip_qkv` clamps q, k and v after
    it (OLMoE). Gemma 3 passes its own `scale` and its norm form (`unit_offset`).

    Under tensor parallelism each rank holds whole GQA groups (a KV head and the query heads
    that read it), as equal a share as the groups allow (SmolLM2's 3 KV heads on 2 ranks: 2
    and 1). With fewer KV heads than ranks, the ranks sharing a KV head each keep a copy of
    it and split its query heads.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, sliding_window: int | None,
                 scale: float | None = None, unit_offset: bool = False):
        super().__init__()
        self.head_dim = config.head_dim
        if config.qk_norm == "projection" and tp_size() > 1:
            raise ValueError("tensor_parallel_size > 1 does not support qk_norm over the whole projection "
                             f"(OLMoE's, {config.architecture}): it normalises across every rank's heads")
        q_start, heads, kv_start, kv_heads = _head_shard(config.num_attention_heads, config.num_key_value_heads)
        self.q_size, self.kv_size = heads * self.head_dim, kv_heads * self.head_dim
        q_part, kv_part = (q_start * self.head_dim, self.q_size), (kv_start * self.head_dim, self.kv_size)
        full_q, full_kv = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [full_q, full_kv, full_kv],
                                             config.attention_bias, [q_part, kv_part, kv_part])
        self.o_proj = RowParallelLinear(full_q, config.hidden_size, config.attention_out_bias, q_part)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            q_dim, k_dim = (self.head_dim, self.head_dim) if self.qk_norm == "head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, unit_offset=unit_offset)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, unit_offset=unit_offset)
        self.clip_qkv = config.clip_qkv
        self.rotary = rotary
        self.attn = Attention(heads, kv_heads, self.head_dim, self.head_dim ** -0.5 if scale is None else scale,
                              sliding_window, rotary.inv_freq)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v).flatten(1))


def _head_shard(heads: int, kv_heads: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of this rank."""
    rank, size = tp_rank(), tp_size()
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    group = heads // kv_heads
    if kv_heads >= size:  # whole groups, as even as they divide
        first, end = -(-rank * kv_heads // size), -(-(rank + 1) * kv_heads // size)
        return first * group, (end - first) * group, first, end - first
    if size % kv_heads or group % (size // kv_heads):
        raise ValueError(f"tensor_parallel_size={size} must be a multiple of num_key_value_heads={kv_heads} "
                         f"that divides its {group} query heads per KV head, where it exceeds the KV heads")
    copies = size // kv_heads
    share = group // copies
    return rank // copies * group + rank % copies * share, share, rank // copies, 1


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x)); the MLP is dense or MoE."""

    def __init__(self, config: ModelConfig, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    # a backend's fused run of every layer and the final norm for the steps it serves (positions, x) -> ran
    decode_stack: Callable[[torch.Tensor, torch.Tensor], bool] | None = None

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.decode_stack is not None and self.decode_stack(positions, x):
            return x  # the stack ran every layer and the norm, in place: x is the embedding lookup's own tensor
        for layer in self.layers:
            x = layer(positions, x)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> ModelConfig:
        bias = cfg.get("attention_bias", False)
        if arch.startswith("Qwen") and cfg.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen configs with use_sliding_window=true are not supported")
        return ModelConfig(
            **common_fields(arch, cfg),
            attention_bias=True if arch == "Qwen2ForCausalLM" else bias,
            attention_out_bias=bias if arch in ("LlamaForCausalLM", "MistralForCausalLM") else False,
            qk_norm="head" if arch == "Qwen3ForCausalLM" else None,
            sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        )

    def __init__(self, config: ModelConfig):
        rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        layers = [DecoderLayer(config, LlamaAttention(config, rotary, config.sliding_window), self.mlp(config, i))
                  for i in range(config.num_hidden_layers)]
        super().__init__(config, LlamaModel(config, layers))

    def mlp(self, config: ModelConfig, layer: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
