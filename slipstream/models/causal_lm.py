"""CausalLM: what every decoder-only family shares on top of its body.

A family builds `model` (embeddings, decoder layers, final norm) and passes it here; this
class adds the LM head (tied to the embeddings when the config says so) and the interface
the model runner calls.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from slipstream.layers.attention import Attention
from slipstream.layers.embedding import ParallelLMHead
from slipstream.layers.linear import Linear
from slipstream.layers.moe import reset_routing_stats, routing_stats
from slipstream.models.config import ModelConfig
from slipstream.models.weights import load_stacked_weights


def scaled_embedding(embedding: nn.Embedding, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Gemma's embeddings times `scale`, which the reference rounds to the weight dtype first
    (sqrt(640) becomes 25.25 in bf16). The factor stays a host scalar: no copy to the device each step."""
    x = embedding(ids)  # in the weight dtype, whether the table is a float weight or GGUF blocks
    return x * torch.tensor(scale, dtype=x.dtype)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, model: nn.Module):
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_stacked_weights(self, weights)

    def use_decode_stack(self, stack) -> None:
        """Let the body run whole decode steps through a backend's fused stack, where the body
        has such a path (the llama family's)."""
        if stack is not None and hasattr(self.model, "decode_stack"):
            self.model.decode_stack = stack

    def routing_stats(self) -> dict[int, list[int]]:
        """Tokens each expert has received so far, per MoE layer (the engine's `expert_load`); {} when dense."""
        return routing_stats(self.model.layers)

    def reset_routing_stats(self) -> None:
        reset_routing_stats(self.model.layers)

    def attention_layers(self) -> list[Attention]:
        """The attention layers that own a KV cache, in layer order (Gemma 4's KV-sharing
        layers own none: they attend through an earlier layer's)."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    @torch.no_grad()
    def value_weights(self, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor | None]:
        """Per attention layer (as `attention_layers`), [KV heads, head dim]: the energy of each value channel's
        column of the output projection beside it (`o_proj`), summed over the query heads that read the KV head;
        a TurboQuant cache spreads its values' error by it (kvcache/turboquant_cache.py). The columns come from
        the projection's own method on unit rows, so any weight layout or format serves, and under tensor
        parallelism each rank's own columns, with no all-reduce. None where a layer has no `o_proj` beside it."""
        found = {}
        for module in self.modules():
            attn, proj = getattr(module, "attn", None), getattr(module, "o_proj", None)
            if isinstance(attn, Attention) and isinstance(proj, Linear):
                energy = _column_energy(proj, dtype, device)
                found[attn] = energy.view(attn.num_kv_heads, -1, attn.head_dim).sum(1)
        return [found.get(attn) for attn in self.attention_layers()]


def _column_energy(proj: Linear, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """|W[:, j]|^2 for each input feature j of `proj`, bias left out."""
    eye = torch.eye(proj.in_features, dtype=dtype, device=device)
    columns = proj.method.apply(proj, eye).float() - proj.method.apply(proj, torch.zeros_like(eye[:1])).float()
    return columns.square().sum(1)
