"""Our llama-family model against transformers on tiny random checkpoints (float32)."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from tests.conftest import build_tiny_checkpoint, hf_greedy, hf_prompt_logprobs, random_prompts

FAMILIES = [
    ("llama", 4),   # MHA
    ("llama", 2),   # GQA
    ("llama", 1),   # MQA
    ("mistral", 2),
    ("qwen2", 2),   # q/k/v bias
    ("qwen3", 2),   # per-head q/k RMSNorm
]
LOGPROB_TOL = 2e-4  # float32 vs float32, different kernels: observed max |diff| ~ 1e-5


@pytest.mark.parametrize("family,num_kv_heads", FAMILIES, ids=[f"{f}-kv{k}" for f, k in FAMILIES])
def test_matches_transformers(tmp_path, family, num_kv_heads):
    path = build_tiny_checkpoint(str(tmp_path), family, num_kv_heads=num_kv_heads, seed=num_kv_heads)
    prompts = random_prompts(5, 3, 70, seed=1)
    expected = hf_greedy(path, prompts, max_new_tokens=12)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)  # small budget: chunked prefill too
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, out in zip(prompts, outputs):
        ours = torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])
        ref = hf_prompt_logprobs(path, prompt)
        assert torch.allclose(ours, ref, atol=LOGPROB_TOL, rtol=0), (ours - ref).abs().max()
    assert llm.stats()["num_used_blocks"] == 0


def test_kv_cache_holds_only_kv_heads(tmp_path):
    path = build_tiny_checkpoint(str(tmp_path), "llama", num_kv_heads=1)
    llm = LLM(path, dtype="float32")
    layer = llm.engine.kv_cache.layers[0]
    assert layer.k.shape[0] == 1 and layer.k.shape[-1] == 16  # one KV head of dim 16, never repeated for the 4 query heads
    assert llm.stats()["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 4
