"""Architecture name (as in an HF config's `architectures`) -> model class.

A model class provides `config_from_hf(arch, cfg) -> ModelConfig`, `load_weights`,
`forward(input_ids, positions)`, `compute_logits` and `attention_layers()`.
"""
from __future__ import annotations

from torch import nn

from slipstream.models.config import ModelConfig, UnsupportedModelError
from slipstream.models.gemma3 import Gemma3ForCausalLM
from slipstream.models.gemma4 import Gemma4ForCausalLM
from slipstream.models.llama import LlamaForCausalLM
from slipstream.models.mixtral import MixtralForCausalLM
from slipstream.models.olmoe import OlmoeForCausalLM
from slipstream.models.qwen_moe import QwenMoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": QwenMoeForCausalLM,
    "Qwen3MoeForCausalLM": QwenMoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # text model only
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def config_from_hf(cfg: dict) -> ModelConfig:
    """The family's config for an HF-style config dict whose `eos_token_id` is a list."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"architecture {arch!r} is not supported; "
                                    f"supported: {', '.join(sorted(ARCHITECTURES))}")
    config = ARCHITECTURES[arch].config_from_hf(arch, cfg)
    config.eos_token_ids = list(cfg.get("eos_token_id") or [])
    return config


def build_model(config: ModelConfig) -> nn.Module:
    return ARCHITECTURES[config.architecture](config)
