"""The bundled SmolLM2 GGUF run as stored (its Q4_1 / Q8_0 blocks in memory) against transformers
float32 on the same file's dequantized weights, its weight memory, and how the format is chosen."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.loader.gguf import GGUFFile
from slipstream.loader.registry import resolve_model_path
from tests.layers.test_quantization import _english_ids, _perplexity
from tests.models.test_smollm2_reference import MAX_NEW, _prompts, reference  # noqa: F401  (a fixture)

# float32 activations: the blocks' GEMM is dequantize-then-multiply to float32 rounding, so the
# reference test's own bound holds; measured max |diff| 5.7e-5 over the 8 prompts (599 tokens the longest)
FP32_LOGPROB_TOL = 2e-3
# bf16 activations (the default on this CPU), as far from float32 as the widened bf16 path is; measured
# with AMX (Q4_1 prefill on bf16-rounded weights in AMX tiles, as widened) max |diff| 0.347, mean per prompt
# <= 0.069, 5 of 8 prompts with all 32 greedy tokens equal (widened: 0.347, 0.069, 4 of 8); as a CPU without
# AMX (16-bit fixed-point activations below 128 rows, float32 above) 0.406, 0.105, 6 of 8 (widened: 0.399,
# 0.069, 4 of 8). bf16's rounding of activations tips near-ties.
BF16_LOGPROB_MAX, BF16_LOGPROB_MEAN, BF16_GREEDY_PROMPTS = 0.5, 0.15, 4
MEMORY_BOUND = 1.05  # weight memory / the file's tensor bytes


def _run(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def expected(reference):  # noqa: F811
    """The prompts, and transformers' greedy tokens and prompt logprobs for each, computed once."""
    tokenizer, model = reference
    prompts, refs = _prompts(tokenizer), []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            logprobs = model(ids).logits[0, :-1].float().log_softmax(-1).gather(1, ids[0, 1:, None]).squeeze(1)
            refs.append((tokens, logprobs))
    return prompts, refs


def _compare(refs, outputs) -> tuple[int, list[torch.Tensor]]:
    """(prompts whose greedy tokens are transformers', |logprob diff| per prompt of 2+ tokens)."""
    same, diffs = 0, []
    for (tokens, ref_lp), out in zip(refs, outputs):
        same += out.outputs[0].token_ids == tokens
        if len(ref_lp):
            ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
            diffs.append((ours - ref_lp).abs())
    return same, diffs


@pytest.mark.slow
def test_as_stored_in_float32_matches_transformers(expected):
    prompts, refs = expected
    llm = LLM("smollm2-135m", quantization="gguf", dtype="float32", max_num_batched_tokens=256)
    assert llm.engine.quantization == "gguf"
    same, diffs = _compare(refs, _run(llm, prompts))
    assert same == len(prompts)
    assert max(d.max().item() for d in diffs) < FP32_LOGPROB_TOL


@pytest.mark.slow
def test_as_stored_in_bf16_stays_within_measured_bounds(expected):
    prompts, refs = expected
    llm = LLM("smollm2-135m", quantization="gguf", max_num_batched_tokens=256)  # bf16 activations here
    same, diffs = _compare(refs, _run(llm, prompts))
    assert same >= BF16_GREEDY_PROMPTS
    assert max(d.max().item() for d in diffs) < BF16_LOGPROB_MAX
    assert max(d.mean().item() for d in diffs) < BF16_LOGPROB_MEAN


def _weight_bytes(model: torch.nn.Module) -> int:
    """Parameter and buffer bytes, a tensor shared by two modules (the tied head's blocks) once."""
    tensors = {t.data_ptr(): t.nbytes for t in [*model.parameters(), *model.buffers()]}
    return sum(tensors.values())


def test_weight_memory_is_the_file_s_size(smollm2_gguf):
    llm = LLM("smollm2-135m", quantization="gguf", kv_cache_memory=2**20)
    model = llm.engine.runner.model
    assert model.lm_head.weight is None and model.lm_head.method.name == "gguf"
    assert _weight_bytes(model) <= MEMORY_BOUND * GGUFFile(smollm2_gguf).tensor_bytes()


def test_skip_tokenizer_init_takes_token_ids_and_decodes_the_same_tokens():
    """No tokenizer is converted from the file: text prompts are refused naming the option, token-id
    prompts give the tokens a tokenizer-equipped engine gives, with empty texts."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bare = LLM("smollm2-135m", skip_tokenizer_init=True, kv_cache_memory=2**22)
    assert bare.get_tokenizer() is None
    with pytest.raises(ValueError, match="no tokenizer is loaded .*skip_tokenizer_init=True"):
        bare.generate(["The capital of France is"], params, use_tqdm=False)
    full = LLM("smollm2-135m", kv_cache_memory=2**22)
    prompt = full.get_tokenizer()("The capital of France is").input_ids
    out = bare.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out.text == ""


def test_a_quantized_gguf_runs_as_stored_unless_a_dtype_is_named(smollm2_gguf, tiny_llama):
    """The default where the backend runs blocks natively (the CPU backend with its kernels; without
    them the torch twin would dequantize every call, so the file is widened); a named dtype widens."""
    default = LLM("smollm2-135m", kv_cache_memory=2**20).engine
    assert default.quantization == ("gguf" if default.backend.runs_gguf_blocks else None)
    assert LLM("smollm2-135m", quantization="gguf", kv_cache_memory=2**20).engine.quantization == "gguf"
    widened = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory=2**20).engine
    assert widened.quantization is None
    assert widened.runner.model.lm_head.weight.dtype == torch.bfloat16
    assert LLM(tiny_llama, dtype="float32", quantization="int4").engine.quantization == "int4"
    with pytest.raises(ValueError, match=r"quantization='gguf' runs a GGUF file's blocks; .* is not a .gguf file"):
        LLM(tiny_llama, quantization="gguf")


@pytest.mark.slow
def test_gemma3_as_stored_in_float32_matches_the_widened_path():
    """Gemma 3's file mixes Q5_0, Q4_K, Q6_K and Q8_0 (q/k and v of one projection in different
    formats) and stores norms as 1 + w; widened to float32 it is held to transformers by
    test_gemma3.py, so as stored it must give the same tokens and logprobs to float32 rounding."""
    import argparse

    prompts = None
    results = []
    for kwargs in ({"quantization": "gguf"}, {}):
        llm = LLM("gemma3-270m", dtype="float32", max_num_batched_tokens=64, kv_cache_memory=64 * 2**20, **kwargs)
        assert llm.engine.quantization == kwargs.get("quantization")
        if kwargs:  # as stored, its weight memory is the file's (the rotary tables are made per step)
            file_bytes = GGUFFile(resolve_model_path("gemma3-270m")).tensor_bytes()
            assert _weight_bytes(llm.engine.runner.model) <= MEMORY_BOUND * file_bytes
        # 200 tokens in 64-token chunks: every prompt logprob costs a 262k-wide row of logits
        prompts = prompts or [llm.get_tokenizer()(t).input_ids[:200] for t in ("The capital of France is", argparse.__doc__)]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
        results.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    for stored, widened in zip(*results):
        assert stored.outputs[0].token_ids == widened.outputs[0].token_ids
        ours, ref = ([next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in (stored, widened))
        assert (torch.tensor(ours) - torch.tensor(ref)).abs().max() < FP32_LOGPROB_TOL


# as stored against widened to bf16, both with bf16 activations (the bound); measured on 512 tokens
# with AMX: SmolLM2 7.037 against 7.037 (its prefill multiplies the same bf16 weights on AMX tiles), Gemma 3
# 5.964 against 5.969 (-0.09%); as a CPU without AMX SmolLM2 7.058 against 7.031 (+0.39%: 16-bit fixed-point
# activations below 128 rows)
PERPLEXITY_TOLERANCE = 0.005


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_perplexity_as_stored_is_the_widened_path_s(model):
    """Real English (512 tokens of stdlib docstrings): the blocks as stored lose no more than 0.5% of
    perplexity against the same file widened to bf16."""
    ids, perplexity = None, {}
    for name, weights in (("stored", {"quantization": "gguf"}), ("widened", {"dtype": "bfloat16"})):
        llm = LLM(model, max_num_batched_tokens=128, kv_cache_memory=64 * 2**20, **weights)
        assert llm.engine.quantization == ("gguf" if name == "stored" else None)
        ids = ids or _english_ids(llm.get_tokenizer(), 512)
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        perplexity[name] = _perplexity(torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]))
        del llm
    print(model, perplexity)
    assert abs(perplexity["stored"] / perplexity["widened"] - 1) <= PERPLEXITY_TOLERANCE, perplexity


def test_deterministic_covers_repacked_blocks_and_names_the_others():
    """Every format of both bundled files (SmolLM2's Q4_1/Q8_0; Gemma 3's Q5_0, Q4_K, Q6_K, Q8_0 and q/k/v
    fused from two of them) runs on gemm.c's invariant kernels; a GGUF layer they cannot tile is named."""
    from slipstream.backends.cpu.backend import CpuBackend
    from slipstream.backends.cpu.capability import CpuCapability
    from slipstream.layers.gguf_linear import GGUFWeight
    from slipstream.layers.linear import Linear
    from tests.layers.test_gguf_formats import attach_to, random_blocks

    capability = CpuCapability.detect()
    if not capability.gemm:
        pytest.skip("deterministic=True needs gemm.c's invariant kernels, which this build lacks")
    for model in ("smollm2-135m", "gemma3-270m"):  # bf16 asked: the default is float32 on a CPU without bf16
        engine = LLM(model, dtype="bfloat16", quantization="gguf", deterministic=True, kv_cache_memory=2**20).engine
        assert engine.quantization == "gguf" and engine.backend.batch_invariant, model
    holder = torch.nn.Module()
    holder.proj = Linear(256, 40, bias=False)  # 40 rows: not whole blocks of 16 columns
    attach_to(holder.proj, GGUFWeight.from_blocks("Q6_K", random_blocks("Q6_K", 40, 256), 256))
    holder.proj.dtype = torch.bfloat16
    backend = CpuBackend(capability, deterministic=True)
    backend.prepare(holder, "gguf")
    assert backend.invariance_gaps(holder) == ["GGUF layers proj (rows gemm.c cannot tile by 16; "
                                               "dtype='bfloat16' widens them)"]
