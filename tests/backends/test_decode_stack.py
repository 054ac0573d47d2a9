"""Decode steps through kernels/decoder_layer.c (one call for all layers), in every kernel build whose
GEMMs it can use, against the per-kernel torch path."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.backends.cpu.decode_stack import DecodeStack, RotaryTables
from slipstream.layers.rotary import RotaryEmbedding
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.models.test_gemma3 import build_tiny_gemma3

# bf16 on both sides; the paths round every intermediate alike, SiLU and GELU included (gemm.c's
# silu_and_mul_bf16 / gelu_tanh_and_mul_bf16), and run the same GEMM kernel for a given number of tokens
# (backends/cpu/linear.py's GemmPolicy): the logprobs are the same bits (batch invariance).
# qwen3: per-head q/k norms; gemma3: Gemma's norms (unit offset, the blocks' outputs normalised too), GELU,
# two rotary bases, sliding windows on 2 layers of 3 (shorter than the sequences), MQA
CASES = [("llama", 4, None), ("llama", 1, None), ("llama", 2, "int8"), ("llama", 2, "int4"), ("mistral", 2, None),
         ("qwen3", 2, None), ("gemma3", 1, None), ("gemma3", 2, "int4")]
# TurboQuant caches: the codes written and read by turboquant_encode.c / turboquant_attention.c from inside the
# stack, and the 16-bit window (6 newest, 2 first tokens: shorter than the sequences) staged there
TURBOQUANT = [("llama", 2, None, "tq3"), ("llama", 1, "int8", "tq4"), ("mistral", 4, None, "tq-k4v2-qjl"),
              ("gemma3", 1, None, "tq4")]
# 4 sequences decode on the AVX-512 GEMMs; 16 reach every format's
# AMX_MIN_ROWS, so that the AMX kernels run inside the native stack where the machine has them
SEQUENCES = [4, 16]


def _generate(path: str, quantization: str | None, prompts: list[list[int]], **engine_args):
    llm = LLM(path, dtype="bfloat16", quantization=quantization, enable_prefix_caching=False, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    logprobs = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outputs]
    return llm, [o.outputs[0].token_ids for o in outputs], torch.tensor(logprobs)


def _checkpoint(tmp_path, family: str, num_kv_heads: int) -> str:
    if family == "gemma3":
        return build_tiny_gemma3(str(tmp_path), num_kv_heads=num_kv_heads, seed=3)
    # mistral: a sliding window shorter than the sequences, so the window rule is exercised
    overrides = {"sliding_window": 12} if family == "mistral" else {}
    return build_tiny_checkpoint(str(tmp_path), family, num_kv_heads=num_kv_heads, seed=3, **overrides)


def _count_calls(monkeypatch) -> list[int]:
    calls = [0]
    original = DecodeStack.run

    def counted(self, layers, step, x):
        calls[0] += 1
        return original(self, layers, step, x)

    monkeypatch.setattr(DecodeStack, "run", counted)
    return calls


@pytest.mark.parametrize("sequences", SEQUENCES)
@pytest.mark.parametrize("family,num_kv_heads,quantization", CASES,
                         ids=[f"{f}-kv{k}-{q or 'bf16'}" for f, k, q in CASES])
def test_native_decode_matches_the_per_kernel_path(gemm_isa, tmp_path, monkeypatch, family, num_kv_heads, quantization,
                                                    sequences):
    path = _checkpoint(tmp_path, family, num_kv_heads)
    prompts = random_prompts(sequences, 3, 20, seed=2)  # ragged lengths: different positions and block tables per row
    calls = _count_calls(monkeypatch)
    llm, tokens, logprobs = _generate(path, quantization, prompts, block_size=4)
    assert calls[0] == 9  # 9 decode steps of all the sequences
    assert llm.stats()["num_used_blocks"] == 0
    monkeypatch.setattr(DecodeStack, "described", lambda self: None)
    _, expected_tokens, expected_logprobs = _generate(path, quantization, prompts, block_size=4)
    assert tokens == expected_tokens
    assert torch.equal(logprobs, expected_logprobs)


def test_layers_the_kernel_does_not_cover_keep_the_torch_path(gemm_isa, tmp_path, monkeypatch):
    path = build_tiny_checkpoint(str(tmp_path), "qwen2", num_kv_heads=2)  # q/k/v biases
    calls = _count_calls(monkeypatch)
    llm, tokens, _ = _generate(path, None, random_prompts(2, 3, 8, seed=1))
    assert calls[0] == 0 and all(len(t) == 10 for t in tokens)
    assert llm.engine.runner.model.model.decode_stack.described() is None


@pytest.mark.parametrize("window", [(6, 2), (0, 0)], ids=["window", "codes"])
@pytest.mark.parametrize("family,num_kv_heads,quantization,kv_cache_dtype", TURBOQUANT,
                         ids=[f"{f}-kv{k}-{q or 'bf16'}-{d}" for f, k, q, d in TURBOQUANT])
def test_native_decode_over_turboquant_matches_the_per_kernel_path(gemm_isa, tmp_path, monkeypatch, family,
                                                                   num_kv_heads, quantization, kv_cache_dtype, window):
    path = _checkpoint(tmp_path, family, num_kv_heads)
    prompts = random_prompts(4, 3, 20, seed=2)
    knobs = dict(block_size=4, kv_cache_dtype=kv_cache_dtype, kv_cache_recent_tokens=window[0],
                 kv_cache_sink_tokens=window[1])
    calls = _count_calls(monkeypatch)
    llm, tokens, logprobs = _generate(path, quantization, prompts, **knobs)
    assert calls[0] == 9
    assert llm.stats()["num_used_blocks"] == 0
    monkeypatch.setattr(DecodeStack, "described", lambda self: None)
    _, expected_tokens, expected_logprobs = _generate(path, quantization, prompts, **knobs)
    assert tokens == expected_tokens
    assert torch.equal(logprobs, expected_logprobs)


def test_rotary_tables_cover_each_position_asked_for_with_the_step_tables_rows():
    """The C code reads row p for position p: a table must reach past the longest context, with the rows
    the torch path computes for a step (bit for bit: batch invariance)."""
    local, global_ = RotaryEmbedding(64, 10_000.0), RotaryEmbedding(64, 1_000_000.0)
    tables = RotaryTables([local, global_])
    first = tables.covering(0)
    assert tables.covering(1023) is first and first[0][0].shape == (1024, 32)
    grown = tables.covering(1024)
    assert [cos.shape[0] for cos, _ in grown] == [2048, 2048] and tables.covering(5000)[1][1].shape[0] == 8192
    positions = torch.tensor([0, 1023, 1024, 4999])
    for rotary, (cos, sin) in zip([local, global_], tables.covering(4999)):
        expected_cos, expected_sin = rotary.tables(positions)
        assert torch.equal(cos[positions], expected_cos) and torch.equal(sin[positions], expected_sin)


def test_float32_caches_keep_the_torch_path(gemm_isa, tiny_llama, monkeypatch):
    calls = _count_calls(monkeypatch)
    llm = LLM(tiny_llama, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(random_prompts(2, 3, 8, seed=1), params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs) and calls[0] == 0


# mean |logprob difference| of the decoded tokens against transformers fp32; measured on the
# two prompts below: bf16 0.023 / 0.009, int8 0.046 / 0.021 (the GGUF's Q4_1 weights requantized),
# int4 0.032 / 0.018 (reproduces Q4_1). A broken layer moves them by whole nats.
SMOLLM2_DECODE_TOLERANCE = {None: 0.05, "int8": 0.1, "int4": 0.1}


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_gguf):
    import os

    import transformers

    folder, name = os.path.split(smollm2_gguf)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", list(SMOLLM2_DECODE_TOLERANCE))
def test_smollm2_native_decode_matches_transformers(gemm_isa, smollm2_reference, monkeypatch, quantization):
    """Decode logprobs on the real model (GQA, 30 layers), batched, against transformers in
    float32 scoring the tokens we generated."""
    calls = _count_calls(monkeypatch)
    llm = LLM("smollm2-135m", dtype="bfloat16", quantization=quantization)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(text) for text in ("The history of the printing press begins",
                                                   "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.")]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert calls[0] >= 39
    for prompt, out in zip(prompts, outputs):
        ours = torch.tensor([next(iter(d.values())).logprob for d in out.outputs[0].logprobs])
        with torch.no_grad():
            logits = smollm2_reference(torch.tensor([prompt + out.outputs[0].token_ids])).logits[0, len(prompt) - 1:-1]
        reference = logits.log_softmax(-1).gather(1, torch.tensor(out.outputs[0].token_ids).unsqueeze(1)).squeeze(1)
        difference = (ours - reference).abs().mean().item()
        assert difference <= SMOLLM2_DECODE_TOLERANCE[quantization], difference


@pytest.mark.parametrize("sequences", [1, *SEQUENCES])  # 1: the segments' parts write into the output directly
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_native_decode_of_gguf_blocks_matches_the_per_kernel_path(gemm_isa, monkeypatch, model, sequences):
    """The bundled models as stored: SmolLM2's Q4_1 and Gemma 3's Q5_0, Q4_K, Q6_K and Q8_0 layers repacked
    for gemm.c's int4 and int8 kernels (the blocks and q8 kinds), Gemma's q/k (Q5_0) and v (Q8_0) projection
    fused from two formats (segments)."""
    prompts = random_prompts(sequences, 3, 20, seed=2)
    calls = _count_calls(monkeypatch)
    llm, tokens, logprobs = _generate(model, "gguf", prompts, block_size=4, kv_cache_memory=2**24)
    assert calls[0] == 9
    monkeypatch.setattr(DecodeStack, "described", lambda self: None)
    _, expected_tokens, expected_logprobs = _generate(model, "gguf", prompts, block_size=4, kv_cache_memory=2**24)
    assert tokens == expected_tokens
    assert torch.equal(logprobs, expected_logprobs)
