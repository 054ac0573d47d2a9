"""Gemma 4 text decoder, with the MoE block (Gemma-4-26B-A4B) or without (dense Gemma 4).

What sets it apart from llama:
- sliding-window and global layers (`layer_types`) with their own head size, KV heads and
  rotary embedding: global layers may use a larger head (`global_head_dim`), fewer KV heads,
  keys reused as values (`attention_k_eq_v`), and "proportional" RoPE that rotates only a
  fraction (`partial_rotary_factor`) of each head;
- q/k RMSNorm per head, a scale-free RMSNorm on v, attention scale 1; norms before and
  after attention and MLP (sandwich norms), embeddings scaled by sqrt(hidden_size), a
  learned per-layer output scalar, final logit soft-capping;
- with `enable_moe_block`: a dense MLP and a routed expert block side by side, each with
  its own pre/post norms; the router reads the residual stream (normalised and scaled) and
  multiplies each chosen expert's weight by a learned per-expert scale;
- per-layer inputs (PLE, `hidden_size_per_layer_input` > 0): a second token embedding plus a
  projection of the main one, gated into the residual stream after each layer;
- KV sharing (`num_kv_shared_layers`): the last layers read the K/V of the last earlier layer
  of their type instead of computing their own; they get no cache of their own.

`Gemma4ForConditionalGeneration` checkpoints (the released ones) load too: only the text
model is built; vision and audio towers are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Iterable

import torch
from torch import nn

from slipstream.distributed.parallel_state import tp_size
from slipstream.layers.attention import Attention
from slipstream.layers.linear import Linear
from slipstream.layers.mlp import GatedMLP, activation
from slipstream.layers.moe import SparseMoeBlock
from slipstream.layers.norm import RMSNorm, rms_norm
from slipstream.layers.rotary import RotaryEmbedding
from slipstream.models.causal_lm import CausalLM, scaled_embedding
from slipstream.models.config import ModelConfig, UnsupportedModelError, common_fields
from slipstream.models.gemma3 import FULL, SLIDING
from slipstream.models.weights import load_stacked_weights, rename_weights

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
# checkpoint fragment -> ours (first match wins); the MoE parts live in our SparseMoeBlock `moe`
_RENAMES = {".router.proj.": ".moe.gate.", ".router.": ".moe.gate.", ".experts.": ".moe.experts."}
_MULTIMODAL_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


@dataclass
class Gemma4Config(ModelConfig):
    layer_types: list[str] = field(default_factory=list)
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    rope_by_type: dict = field(default_factory=dict)
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0

    def shares_kv(self, layer: int) -> bool:
        """Whether `layer` attends over the K/V of the last earlier layer of its type, not its own."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return False
        if self.layer_types[layer] not in self.layer_types[:first_shared]:
            raise UnsupportedModelError(f"layer {layer} shares K/V, but no earlier layer is of type "
                                        f"{self.layer_types[layer]!r}")
        return True


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4Config, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_kv_heads[layer]
        self.head_dim = config.layer_head_dims[layer]
        self.layer_type = config.layer_types[layer]
        self.shares_kv = config.shares_kv(layer)
        self.k_eq_v = config.attention_k_eq_v and self.layer_type == FULL
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        num_kv_projections = 0 if self.shares_kv else 1 if self.k_eq_v else 2
        self.qkv_proj = Linear(config.hidden_size, self.q_size + num_kv_projections * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, cast_last=True)
        if not self.shares_kv:
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, cast_last=True)
        self.eps = config.rms_norm_eps
        self.rotary = rotary
        window = config.sliding_window if self.layer_type == SLIDING else None
        # KV-sharing layers own no cache: they attend through their source layer's Attention
        self.attn = None if self.shares_kv else Attention(self.num_heads, self.num_kv_heads, self.head_dim, 1.0, window,
                                                           rotary.inv_freq)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, shared_kv: dict) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim))
        if self.shares_kv:
            k, v, attn = shared_kv[self.layer_type]  # it rewrites the same slots with the same K/V: harmless
            q, _ = self.rotary(positions, q, q[:, :0])  # keys come rotated from the source layer
        else:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
            v = rms_norm(v, self.eps)
            q, k = self.rotary(positions, q, self.k_norm(k))
            attn = self.attn
            shared_kv[self.layer_type] = (k, v, attn)  # the latest of its type: what KV-sharing layers read
        return self.o_proj(attn(q, k, v).flatten(1))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        h = config.hidden_size
        norm = partial(RMSNorm, eps=config.rms_norm_eps, cast_last=True)
        self.input_layernorm = norm(h)
        self.self_attn = Gemma4Attention(config, layer, rotary)
        self.post_attention_layernorm = norm(h)
        self.pre_feedforward_layernorm = norm(h)
        wide = config.use_double_wide_mlp and self.self_attn.shares_kv
        self.mlp = GatedMLP(h, config.intermediate_size * (2 if wide else 1), config.hidden_act)
        self.post_feedforward_layernorm = norm(h)
        self.moe = None
        if config.enable_moe_block:
            self.post_feedforward_layernorm_1 = norm(h)
            self.pre_feedforward_layernorm_2 = norm(h)
            self.moe = SparseMoeBlock(h, config.moe_intermediate_size, config.num_experts, config.top_k_experts,
                                      renormalize=True, act=config.hidden_act, router_input_scale=True,
                                      per_expert_scale=True, eps=config.rms_norm_eps)
            self.post_feedforward_layernorm_2 = norm(h)
        self.per_layer_input = config.hidden_size_per_layer_input > 0
        if self.per_layer_input:
            self.act = activation(config.hidden_act)
            self.per_layer_input_gate = Linear(h, config.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = Linear(config.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = norm(h)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, per_layer_input: torch.Tensor | None,
                shared_kv: dict) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), shared_kv))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:  # dense MLP and routed experts side by side; the router reads the residual
            routed = self.moe(self.pre_feedforward_layernorm_2(x), router_input=x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.per_layer_input:
            gated = self.act(self.per_layer_input_gate(x)) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config: Gemma4Config):
        if tp_size() > 1:
            raise ValueError("tensor_parallel_size > 1 does not support Gemma 4 (per-layer inputs, KV sharing "
                             "and its MoE block are not sharded); supported: the llama family, Mixtral, "
                             "Qwen2/3-MoE and Gemma 3")
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotaries: dict[tuple[str, int], RotaryEmbedding] = {}
        layers = []
        for i, kind in enumerate(config.layer_types):
            key = (kind, config.layer_head_dims[i])
            if key not in rotaries:
                rotaries[key] = gemma_rotary(key[1], config.rope_by_type[kind])
            layers.append(Gemma4DecoderLayer(config, i, rotaries[key]))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, cast_last=True)
        ple = config.hidden_size_per_layer_input
        if ple:
            total = config.num_hidden_layers * ple
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, total)
            self.per_layer_model_projection = Linear(config.hidden_size, total, bias=False)
            self.per_layer_projection_norm = RMSNorm(ple, config.rms_norm_eps, cast_last=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = scaled_embedding(self.embed_tokens, input_ids, self.config.hidden_size ** 0.5)
        per_layer = self._per_layer_inputs(input_ids, x) if self.config.hidden_size_per_layer_input else None
        shared_kv: dict = {}
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if per_layer is None else per_layer[:, i], shared_kv)
        return self.norm(x)

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, num_layers, P]: (normed projection of the embedding + per-layer token embedding) / sqrt(2)."""
        c = self.config
        shape = (-1, c.num_hidden_layers, c.hidden_size_per_layer_input)
        projected = self.per_layer_model_projection(x) * c.hidden_size ** -0.5
        projected = self.per_layer_projection_norm(projected.view(shape))
        token = scaled_embedding(self.embed_tokens_per_layer, input_ids, c.hidden_size_per_layer_input ** 0.5)
        return (projected + token.view(shape)) * 2 ** -0.5


class Gemma4ForCausalLM(CausalLM):
    @staticmethod
    def config_from_hf(arch: str, cfg: dict) -> Gemma4Config:
        cfg = cfg.get("text_config") or cfg  # Gemma4ForConditionalGeneration nests the text model
        if cfg.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError("Gemma 4 configs with use_bidirectional_attention='all' are not supported")
        num_layers = cfg["num_hidden_layers"]
        layer_types = list(cfg.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)])
        layer_types[-1] = FULL  # transformers forces the last layer global
        head_dims, kv_heads = _per_layer_shapes(cfg, layer_types)
        rope = {**_DEFAULT_ROPE, **(cfg.get("rope_parameters") or {})}
        moe = cfg.get("enable_moe_block", False)
        fields = common_fields(arch, cfg) | dict(
            num_key_value_heads=cfg.get("num_key_value_heads", 4),
            head_dim=cfg.get("head_dim", 256),
            max_position_embeddings=cfg.get("max_position_embeddings", 131_072),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            hidden_act=cfg.get("hidden_activation", "gelu_pytorch_tanh"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )
        return Gemma4Config(
            **fields,
            attention_bias=cfg.get("attention_bias", False),
            sliding_window=cfg.get("sliding_window", 512),
            layer_types=layer_types,
            layer_head_dims=head_dims,
            layer_kv_heads=kv_heads,
            rope_by_type={kind: rope[kind] for kind in set(layer_types)},
            attention_k_eq_v=cfg.get("attention_k_eq_v", False),
            num_kv_shared_layers=cfg.get("num_kv_shared_layers", 0),
            use_double_wide_mlp=cfg.get("use_double_wide_mlp", False),
            enable_moe_block=moe,
            num_experts=cfg["num_experts"] if moe else 0,
            top_k_experts=cfg["top_k_experts"] if moe else 0,
            moe_intermediate_size=cfg["moe_intermediate_size"] if moe else 0,
            hidden_size_per_layer_input=cfg.get("hidden_size_per_layer_input", 256),
            vocab_size_per_layer_input=cfg.get("vocab_size_per_layer_input", 262_144),
        )

    def __init__(self, config: Gemma4Config):
        super().__init__(config, Gemma4Model(config))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_stacked_weights(self, rename_weights(_text_weights(weights, self.config), _RENAMES))


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]], config: Gemma4Config):
    """The text model's tensors under our names: multimodal towers and unused K/V tensors dropped."""
    for name, tensor in weights:
        if name.startswith(_MULTIMODAL_PREFIXES):
            continue
        name = name.replace("model.language_model.", "model.", 1)
        parts = name.split(".")
        if (len(parts) > 4 and parts[1] == "layers" and parts[3] == "self_attn"
                and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm")
                and config.shares_kv(int(parts[2]))):
            continue  # KV-sharing layers may carry K/V weights they never use
        yield name, tensor


def _per_layer_shapes(cfg: dict, layer_types: list[str]) -> tuple[list[int], list[int]]:
    """Head size and KV heads of every layer: sliding layers use the base values, global layers
    `per_layer_config` (as transformers saves it) or `global_head_dim` / `num_global_key_value_heads`."""
    head_dims = [cfg.get("head_dim", 256)] * len(layer_types)
    kv_heads = [cfg.get("num_key_value_heads", 4)] * len(layer_types)
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        default = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
            default["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: default for i, kind in enumerate(layer_types) if kind == FULL}
    for key, values in overrides.items():
        unknown = set(values) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedModelError(f"per_layer_config overrides {sorted(unknown)} are not supported")
        targets = [i for i, kind in enumerate(layer_types) if kind == key] if key in (SLIDING, FULL) else [int(key)]
        for i in targets:
            head_dims[i] = values.get("head_dim", head_dims[i])
            kv_heads[i] = values.get("num_key_value_heads", kv_heads[i])
    return head_dims, kv_heads


def gemma_rotary(head_dim: int, params: dict) -> RotaryEmbedding:
    """RoPE of one layer type. "proportional" rotates the first `partial_rotary_factor` of the
    frequency pairs (exponents still over the whole head) and leaves the rest unrotated."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise UnsupportedModelError(f"Gemma 4 rope type {rope_type!r} is not supported; supported: default, proportional")
    theta = params.get("rope_theta", 10_000.0)
    rotary = RotaryEmbedding(head_dim, theta)
    if rope_type == "proportional":
        rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        inv_freq = torch.zeros(head_dim // 2)
        inv_freq[:rotated] = 1.0 / theta ** (torch.arange(0, 2 * rotated, 2).float() / head_dim)
        rotary.inv_freq = inv_freq / params.get("factor", 1.0)
    return rotary

