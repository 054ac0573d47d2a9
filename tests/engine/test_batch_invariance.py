"""With deterministic=True, bf16, int8 and int4 greedy outputs, tokens and logprobs bit for bit, do
not depend on what else is in the batch, on the prefill chunk size, on prefix-cache hits or on
preemption: each request equals itself run alone. Held where the native kernels exist (tests ask
the capability); refused, with the reason, for what they do not cover."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from tests.conftest import random_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 2 * 16  # K+V, 2 layers, 2 KV heads, dim 16, bf16, 16 tokens
FORMATS = [None, pytest.param("int8", marks=pytest.mark.slow), pytest.param("int4", marks=pytest.mark.slow)]


def _outputs(outputs) -> list[tuple]:
    """Each request's tokens and the logprob of each, as floats compared exactly."""
    return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outputs]


def _llm(model: str, fmt: str | None, **kwargs) -> LLM:
    _skip_without_invariant_kernels()
    return LLM(model, dtype="bfloat16", quantization=fmt, deterministic=True, **kwargs)


def _skip_without_invariant_kernels() -> None:
    backend = CpuBackend(CpuCapability.detect())
    if not backend.capability.gemm:
        pytest.skip(f"backend {backend.name} has no batch-invariant kernels: " + backend.describe()[-1])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """16 prompts, four of them sharing a 40-token prefix (prefix-cache hits within a run, where a
    later one is scheduled after an earlier one's blocks filled)."""
    shared = random_prompts(1, 40, 40, seed=3)[0]
    return random_prompts(12, 5, 60, seed=7) + [shared + p for p in random_prompts(4, 1, 20, seed=5)]


@pytest.fixture(scope="module", params=FORMATS, ids=lambda f: f or "bf16")
def fmt(request) -> str | None:
    return request.param


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts, fmt) -> list[tuple]:
    llm = _llm(tiny_llama, fmt, enable_prefix_caching=False)
    return [_outputs(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]


def test_batch_equals_alone(tiny_llama, prompts, fmt, alone):
    llm = _llm(tiny_llama, fmt)
    assert _outputs(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone


def test_batch_without_prefix_caching_equals_alone(tiny_llama, prompts, fmt, alone):
    llm = _llm(tiny_llama, fmt, enable_prefix_caching=False)
    assert _outputs(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone


def test_mixed_with_other_traffic_equals_alone(tiny_llama, prompts, fmt, alone):
    """Among other requests of other lengths, sampled ones among them, arriving in between."""
    others = random_prompts(10, 1, 90, seed=11)
    sampled = SamplingParams(temperature=1.0, seed=1, max_tokens=9)
    mixed = [x for pair in zip(prompts[:10], others) for x in pair] + prompts[10:]
    params = [PARAMS if i % 2 == 0 or i >= 20 else sampled for i in range(len(mixed))]
    got = _llm(tiny_llama, fmt).generate(mixed, params, use_tqdm=False)
    assert _outputs(got[0:20:2] + got[20:]) == alone


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_equals_alone(tiny_llama, prompts, fmt, alone, budget):
    llm = _llm(tiny_llama, fmt, max_num_batched_tokens=budget)
    assert _outputs(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone


def test_warm_prefix_cache_equals_alone(tiny_llama, prompts, fmt, alone):
    llm = _llm(tiny_llama, fmt)
    llm.generate(prompts, PARAMS, use_tqdm=False)  # every prompt's full blocks are now cached
    hits = llm.stats()["prefix_cache_hits"]
    assert _outputs(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone
    assert llm.stats()["prefix_cache_hits"] > hits


def test_preemption_equals_alone(tiny_llama, prompts, fmt, alone):
    llm = _llm(tiny_llama, fmt, kv_cache_memory=8 * BLOCK_BYTES)
    assert llm.stats()["num_blocks"] == 8
    assert _outputs(llm.generate(prompts, PARAMS, use_tqdm=False)) == alone
    assert llm.stats()["num_preemptions"] > 0


def test_the_torch_backend_says_it_is_not_invariant(no_native_kernels):
    backend = CpuBackend(CpuCapability.detect())
    assert not backend.batch_invariant and backend.describe()[-1].startswith("batch invariance: none")
    with pytest.raises(ValueError, match="deterministic=True needs batch-invariant kernels, which backend cpu-torch"):
        LLM("unused", deterministic=True)


@pytest.mark.parametrize("kwargs,gap", [
    ({"dtype": "float32"}, "dtype torch.float32"), ({"quantization": "w8a8"}, "quantization 'w8a8'"),
    ({"kv_cache_dtype": "tq4"}, "kv_cache_dtype 'tq4'"), ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'")])
def test_deterministic_refuses_what_it_does_not_cover(tiny_llama, kwargs, gap):
    _skip_without_invariant_kernels()
    with pytest.raises(ValueError, match=f"batch invariance does not cover {gap}"):
        LLM(tiny_llama, deterministic=True, **{"dtype": "bfloat16", **kwargs})


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    """16 SiLU experts, top 2: a router and experts the native kernels tile."""
    import transformers

    from tests.models.test_moe_families import COMMON

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**dict(COMMON, intermediate_size=32, num_local_experts=16, num_experts_per_tok=2))
    path = str(tmp_path_factory.mktemp("mixtral16"))
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("budget", [None, 7])
def test_moe_batch_equals_alone(tiny_mixtral, prompts, budget):
    """Every expert group through moe_expert.c whatever its size, a token's experts summed in expert order."""
    llm = _llm(tiny_mixtral, None, enable_prefix_caching=False)
    alone = [_outputs(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in prompts]
    batched = _llm(tiny_mixtral, None, **({} if budget is None else {"max_num_batched_tokens": budget}))
    assert _outputs(batched.generate(prompts, PARAMS, use_tqdm=False)) == alone


@pytest.mark.parametrize("family,gap", [("mixtral", "linear layers model.layers.0.mlp.gate"),  # a 4-expert router
                                        ("gemma4_moe", "MoE experts model.layers.0.moe.experts")])  # GELU experts
def test_deterministic_refuses_layers_no_invariant_kernel_serves(tmp_path, family, gap):
    from tests.models.test_moe_families import build_moe_checkpoint

    _skip_without_invariant_kernels()
    with pytest.raises(ValueError, match=f"does not cover .*{gap}"):
        LLM(build_moe_checkpoint(str(tmp_path / family), family), dtype="bfloat16", deterministic=True)
