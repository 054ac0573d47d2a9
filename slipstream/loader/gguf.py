"""Reading a GGUF file: its metadata into a ModelConfig, its tensors into HF-named float tensors.

Quantized tensors (Q4_1, Q8_0, k-quants, ...) are dequantized with the `gguf` package.
llama.cpp's converter permutes the rows of llama Q and K projections for its rope layout;
we undo that so the weights match the HF layout our model code uses.
"""
from __future__ import annotations

import re
from typing import Iterator

import numpy as np
import torch

from slipstream.config import ModelConfig
from slipstream.loader.hf_config import UnsupportedModelError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFFile:
    def __init__(self, path: str):
        from gguf import GGUFReader

        try:
            self.reader = GGUFReader(path)
        except Exception as e:  # the reader raises assorted errors on a damaged file
            raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
        self.path = path
        self.arch = self.field("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def model_config(self) -> ModelConfig:
        if self.arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} in {self.path} is not supported; "
                f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
        a = self.arch
        hidden = self.field(f"{a}.embedding_length")
        heads = self.field(f"{a}.attention.head_count")
        eos = self.field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=self.tensors["token_embd.weight"].shape[1].item(),
            hidden_size=hidden,
            intermediate_size=self.field(f"{a}.feed_forward_length"),
            num_hidden_layers=self.field(f"{a}.block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self.field(f"{a}.attention.head_count_kv", heads),
            head_dim=self.field(f"{a}.attention.key_length", hidden // heads),
            max_position_embeddings=self.field(f"{a}.context_length"),
            rms_norm_eps=self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self.field(f"{a}.rope.freq_base", 10000.0),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
        )

    def hf_weights(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            hf_name = hf_tensor_name(name)
            w = torch.from_numpy(dequantize(tensor))
            if hf_name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rope_rows(w, config.num_attention_heads)
            elif hf_name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rope_rows(w, config.num_key_value_heads)
            yield hf_name, w


def dequantize(tensor) -> np.ndarray:
    from gguf import quants

    array = quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return array if array.flags.writeable else array.copy()  # memory-mapped F32 data is read-only


def hf_tensor_name(name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} is not recognised")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, pair, half) -> (head, half, pair)."""
    rest = w.shape[1:]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)
