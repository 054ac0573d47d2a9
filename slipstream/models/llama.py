"""The llama family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm), SmolLM2.

Reads like the paper: embedding, N x (norm -> attention -> residual, norm -> gated MLP ->
residual), final norm, LM head. MHA, GQA and MQA differ only in `num_key_value_heads`.
Q/K/V and gate/up projections are fused into one matmul each; `load_weights` stacks the
checkpoint's separate tensors into them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from slipstream.attention import attend
from slipstream.attention.metadata import get_metadata
from slipstream.config import ModelConfig
from slipstream.layers.linear import Linear, silu_and_mul
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.loader.hf_config import UnsupportedModelError, common_fields
from slipstream.models.causal_lm import CausalLM
from slipstream.models.native_decode import NativeDecoder, decode_step

# checkpoint name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window
        self.kv_cache = None  # bound by the model runner once the cache is allocated

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = attend(q, k, v, self.kv_cache, get_metadata(), self.scale, self.sliding_window)
        return self.o_proj(out.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        native = NativeDecoder.of(self.layers)
        step = None if native is None else decode_step(get_metadata(), positions, x, self.layers[0].self_attn.rotary)
        if step is not None:
            native(x, step)  # in place: x is the embedding lookup's own tensor
            return self.norm(x)
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
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=cfg.get("sliding_window") if arch == "MistralForCausalLM" else None,
        )

    def __init__(self, config: ModelConfig):
        super().__init__(config, LlamaModel(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_stacked_weights(self, weights, _STACKED)


def load_stacked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         stacked: dict[str, tuple[str, int]]) -> None:
    """Copy checkpoint tensors into parameters, stacking split projections into fused ones.

    Every parameter must be written exactly once (a tied LM head counts as written by the
    embedding); a missing or unexpected tensor is an error naming it.
    """
    params = dict(model.named_parameters())
    pending = {name: {} for name in params}
    for name, tensor in weights:
        target, shard = name, None
        for fragment, (fused, index) in stacked.items():
            if f".{fragment}." in name:
                target, shard = name.replace(f".{fragment}.", f".{fused}."), index
                break
        if target not in params:
            if getattr(model.config, "tie_word_embeddings", False) and target == "lm_head.weight":
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        pending[target][shard] = tensor
    for name, param in params.items():
        shards = pending[name]
        if not shards:
            raise ValueError(f"checkpoint lacks tensor for parameter {name!r}")
        tensor = shards[None] if None in shards else torch.cat([shards[i] for i in sorted(shards)])
        if tensor.shape != param.shape:
            raise ValueError(f"tensor for {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
