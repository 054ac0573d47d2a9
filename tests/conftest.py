"""Shared fixtures: the bundled SmolLM2 GGUF, tiny random HF checkpoints built with transformers, and
the native kernel builds this CPU can execute."""
from __future__ import annotations

import shutil

import pytest
import torch

from slipstream.attention.metadata import AttentionMetadata, leading_decodes
from slipstream.backends.cpu import abi, build
from slipstream.loader.registry import resolve_model_path

TINY_VOCAB = 384


@pytest.fixture(params=abi.available_isas())
def isa(request, monkeypatch) -> str:
    """Each kernel build this CPU can execute (native, x86-64-v3, x86-64), in turn the engine's."""
    if not build.ENABLED:
        pytest.skip("native kernels are off (SLIPSTREAM_NATIVE=0)")
    if shutil.which(build.COMPILER) is None:
        pytest.skip(f"no C compiler ({build.COMPILER!r}) for native kernels")
    monkeypatch.setattr(build, "ISA", request.param)
    assert abi.kernels() is not None, f"the {request.param} kernels did not build: see the warning logged"
    return request.param


@pytest.fixture
def gemm_isa(isa) -> str:
    """`isa` where its gemm.c has a path (AVX-512); builds without one keep PyTorch's GEMMs."""
    if not abi.kernels().gemm_bf16_available():
        pytest.skip(f"gemm.c has no {isa} path (it needs AVX-512); PyTorch's GEMMs run there")
    return isa


@pytest.fixture
def no_native_kernels(monkeypatch) -> None:
    """The engine as with SLIPSTREAM_NATIVE=0: every kernel on its torch path."""
    monkeypatch.setattr(build, "ENABLED", False)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    return resolve_model_path("smollm2-135m")


def build_tiny_checkpoint(path: str, family: str = "llama", num_kv_heads: int = 2, seed: int = 0, **overrides) -> str:
    """Save a small random model of `family` with transformers; return its directory.

    Weights are drawn wider than transformers' default so that logits are peaked and
    greedy decoding has no near-ties that float rounding could flip.
    """
    import transformers

    configs = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
    }
    kwargs = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512,
                  initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = configs[family](**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_tokenizer(path: str) -> str:
    """A byte-level BPE of TINY_VOCAB tokens (specials 0, 1, 2 = <|endoftext|>, <|im_start|>, <|im_end|>,
    the tiny checkpoints' bos 1 and eos 2) with a ChatML chat template, trained on stdlib docstrings."""
    import argparse
    import json
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([m.__doc__ for m in (argparse, json, string)], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            chat_template=CHATML).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_llama")), "llama", num_kv_heads=2)


SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory, smollm2_gguf) -> str:
    """A tiny random llama with SmolLM2's tokenizer: a real 49k vocabulary for grammars, at random-model speed.

    A random model is an adversarial writer: it puts its mass anywhere in the vocabulary, so
    whatever it emits under a grammar is valid only because the mask made it so.
    """
    from slipstream.loader.tokenizer import load_tokenizer

    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_tokenizer")), "llama", num_kv_heads=2,
                                 vocab_size=SMOLLM2_VOCAB, eos_token_id=2, max_position_embeddings=1024)
    load_tokenizer(smollm2_gguf).save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, **load_kwargs) -> list[list[int]]:
    """Reference greedy continuations from transformers, one prompt at a time (no padding)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_kwargs).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def hf_prompt_logprobs(path: str, prompt: list[int], **load_kwargs) -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers in float32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_kwargs).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)


def random_prompts(n: int, low: int, high: int, seed: int = 0, vocab: int = TINY_VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def step_metadata(query_lens: list[int], context_lens: list[int], block_tables, slot_mapping) -> AttentionMetadata:
    """A step's attention metadata as the runner builds it, rows with one query first;
    block_tables is a [B, W] tensor or one list per row (padded with 0)."""
    if not isinstance(block_tables, torch.Tensor):
        width = max(map(len, block_tables))
        block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables])
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(torch.as_tensor(slot_mapping), torch.tensor(starts), torch.tensor(context_lens),
                             block_tables, leading_decodes(query_lens), starts, list(context_lens))
