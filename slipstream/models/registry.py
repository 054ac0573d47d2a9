"""Architecture name (as in an HF config's `architectures`) -> model class.

A model class provides `config_from_hf(arch, cfg) -> ModelConfig`, `load_weights`,
`forward(input_ids, positions)`, `compute_logits` and `attention_layers()`.
"""
from __future__ import annotations

from torch import nn

from slipstream.config import ModelConfig
from slipstream.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(config: ModelConfig) -> nn.Module:
    return ARCHITECTURES[config.architecture](config)
