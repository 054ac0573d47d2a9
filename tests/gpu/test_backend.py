"""The CUDA backend's choices, and a whole engine on it: the Triton attention kernel (on the
interpreter off a GPU) gives the reference backend's greedy tokens on a tiny random llama."""
from __future__ import annotations

import torch

from slipstream import LLM, SamplingParams
from slipstream.attention import reference
from slipstream.backends.cuda.attention import dense_attention
from slipstream.backends.cuda.backend import CudaBackend
from slipstream.engine import engine
from slipstream.kvcache.cache import LayerKVCache
from tests.conftest import random_prompts
from tests.gpu.steps import DEVICE


def test_dense_caches_get_the_triton_kernel():
    backend = CudaBackend(DEVICE)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert backend.attention(LayerKVCache(2, 16, 1, 64, dtype, DEVICE)) is dense_attention
    assert "Triton" in backend.describe()[0]


def test_without_triton_the_torch_paths_run():
    backend = CudaBackend(DEVICE)
    backend.triton = False
    assert backend.attention(LayerKVCache(2, 16, 1, 64, torch.bfloat16, DEVICE)) is reference.paged_attention
    assert "triton is not installed" in backend.describe()[0]


def test_engine_greedy_tokens_match_the_reference_backend(tiny_llama, monkeypatch):
    prompts = random_prompts(3, 5, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kwargs = dict(model=tiny_llama, dtype="float32", device=DEVICE.type, max_num_batched_tokens=48,
                  kv_cache_memory=2**20)
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(engine, "select_backend", CudaBackend)
    llm = LLM(**kwargs)
    assert isinstance(llm.engine.backend, CudaBackend)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
