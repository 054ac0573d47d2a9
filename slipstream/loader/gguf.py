"""Reading a GGUF file: its metadata into an HF-style config dict, its tensors into HF-named float tensors.

Each supported `general.architecture` has one entry in `GGUF_ARCHITECTURES`: which HF
architecture it is, how its metadata keys and tensor names map to transformers' names,
which config values the file does not store, and which of llama.cpp's conversions to undo.
The metadata becomes an HF-style config dict that the model class parses like config.json.

The header is parsed by loader/gguf_reader.py. Quantized tensors are either kept as the file
stores them (`as_stored`: a `GGUFWeight` of the file's blocks, read from the file one tensor at a
time, for the block formats of layers/gguf_formats.py) or dequantized to float32 with the `gguf`
package; 1-D tensors (norms) and formats without a block twin are always dequantized. llama.cpp's converter permutes the
rows of llama Q and K projections for its rope layout, and stores Gemma's norm weights as
1 + weight; we undo both so the weights match the HF layout our model code uses. The row
permutation moves whole rows, so on blocks it is exact (blocks run along K within a row).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch

from slipstream.layers.gguf_formats import FORMATS
from slipstream.layers.gguf_linear import GGUFWeight
from slipstream.loader.gguf_reader import GGUFReader, SkippedValue, TensorInfo

# GGUF key (after "<arch>.") -> HF config key; keys a file lacks are left out
_CONFIG_KEYS = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
}
_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str
    layer_names: dict[str, str]              # blk.N.<gguf name> -> model.layers.N.<hf name>
    config_keys: dict[str, str] = field(default_factory=lambda: _CONFIG_KEYS)
    defaults: dict = field(default_factory=dict)  # HF config values the file does not store
    unpermute_qk: bool = False               # undo llama.cpp's rope row permutation of Q/K
    norm_offset: float = 0.0                 # subtracted from every *norm.weight


GGUF_ARCHITECTURES = {
    "llama": GGUFArchitecture("LlamaForCausalLM", _LLAMA_LAYER_NAMES, unpermute_qk=True),
    "gemma3": GGUFArchitecture(
        "Gemma3ForCausalLM",
        {**_LLAMA_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
         "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
        config_keys={**_CONFIG_KEYS, "attention.sliding_window": "sliding_window",
                     "final_logit_softcapping": "final_logit_softcapping"},
        # Not stored in Gemma 3 GGUF files; the architecture's documented defaults, which both
        # transformers (Gemma3TextConfig) and llama.cpp assume: every 6th layer global, local
        # rope base 10000, attention scale 256 ** -0.5 (= head_dim ** -0.5 for head_dim 256).
        defaults={"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256},
        norm_offset=1.0,  # llama.cpp's converter stores Gemma norms as 1 + weight
    ),
}


class GGUFFile:
    def __init__(self, path: str):
        try:
            self.reader = GGUFReader(path)
        except Exception as e:  # a damaged file fails in assorted ways (struct, decoding, enum values)
            raise ValueError(f"cannot read GGUF file {path!r}: {e}") from e
        self.path = path
        self.arch = self.field("general.architecture")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def field(self, key: str, default=None):
        value = self.reader.fields.get(key, default)
        if isinstance(value, SkippedValue):
            raise ValueError(f"GGUF field {key!r} is an array of strings, which the header parse skips")
        return value

    @property
    def spec(self) -> GGUFArchitecture:
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} in {self.path} is not supported; "
                             f"supported: {', '.join(GGUF_ARCHITECTURES)}")
        return GGUF_ARCHITECTURES[self.arch]

    def hf_config(self) -> dict:
        """The metadata as an HF config.json dict (`eos_token_id` a list, as `read_hf_config` gives it)."""
        spec = self.spec
        cfg = dict(spec.defaults)
        for key, hf_key in spec.config_keys.items():
            value = self.field(f"{self.arch}.{key}")
            if value is not None:
                cfg[hf_key] = value
        eos = self.field("tokenizer.ggml.eos_token_id")
        cfg.update(architectures=[spec.hf_architecture],
                   vocab_size=self.tensors["token_embd.weight"].shape[1],
                   tie_word_embeddings="output.weight" not in self.tensors,
                   bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
                   eos_token_id=[] if eos is None else [eos])
        return cfg

    def is_quantized(self) -> bool:
        """Whether any matrix is in a block format that can run as stored."""
        return any(_as_stored_format(t) is not None for t in self.tensors.values())

    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors.values())

    def hf_weights(self, as_stored: bool = False) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        """(HF name, tensor) per file tensor; with `as_stored` matrices in a block format come as
        `GGUFWeight`s of the file's blocks."""
        spec = self.spec
        heads = self.field(f"{self.arch}.attention.head_count")
        kv_heads = self.field(f"{self.arch}.attention.head_count_kv") or heads
        for name, tensor in self.tensors.items():
            hf_name = hf_tensor_name(name, spec.layer_names)
            fmt = _as_stored_format(tensor) if as_stored else None
            data = self.reader.read(tensor)
            w = torch.from_numpy(dequantize(data, tensor.tensor_type) if fmt is None else data)
            if spec.unpermute_qk and hf_name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rope_rows(w, heads)
            elif spec.unpermute_qk and hf_name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rope_rows(w, kv_heads)
            elif spec.norm_offset and hf_name.endswith("norm.weight"):
                w = w - spec.norm_offset
            yield hf_name, w if fmt is None else GGUFWeight.from_blocks(fmt, w, tensor.shape[0])


def _as_stored_format(tensor: TensorInfo) -> str | None:
    """The block format a 2-D tensor keeps in memory, or None where it is widened to float."""
    name = tensor.tensor_type.name
    return name if len(tensor.shape) == 2 and name in FORMATS else None


def dequantize(data: np.ndarray, tensor_type) -> np.ndarray:
    from gguf import quants

    return quants.dequantize(data, tensor_type).astype(np.float32, copy=False)


def hf_tensor_name(name: str, layer_names: dict[str, str]) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in layer_names:
        return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"GGUF tensor {name!r} is not recognised")


def unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows (head, pair, half) -> (head, half, pair). Whole rows
    move, so `w` may be float weights [N, K] or a row's blocks [N, row_bytes]."""
    rest = w.shape[1:]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape)
