"""Architecture name -> model class."""
from __future__ import annotations

from torch import nn

from slipstream.config import ModelConfig
from slipstream.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def build_model(config: ModelConfig) -> nn.Module:
    return MODEL_CLASSES[config.architecture](config)
