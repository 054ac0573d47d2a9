"""The CUDA backend's choices, and whole engines on it: its Triton kernels (on the interpreter off a
GPU) give the reference backend's greedy tokens on tiny random llama and MoE models."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.attention import reference, turboquant
from slipstream.backends.cuda.attention import dense_attention, turboquant_encode
from slipstream.backends.cuda.backend import CudaBackend
from slipstream.backends.cuda.experts import TritonExperts
from slipstream.backends.reference import ReferenceBackend
from slipstream.worker import worker
from slipstream.kvcache.cache import LayerKVCache
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from slipstream.layers.moe import Experts
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.gpu.steps import DEVICE
from tests.models.test_moe_families import build_moe_checkpoint


def test_dense_caches_get_the_triton_kernel():
    backend = CudaBackend(DEVICE)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert backend.attention(LayerKVCache(2, 16, 1, 64, dtype, DEVICE)) is dense_attention
    assert "Triton" in backend.describe()[0]


def test_turboquant_caches_get_the_triton_kernels():
    from slipstream.backends.cuda.attention import turboquant_decode, turboquant_prefill

    impl = CudaBackend(DEVICE).attention(TurboQuantLayerCache(2, 16, 1, 64, 3, "mse", seed=0, device=DEVICE))
    assert impl.func is turboquant.paged_attention
    assert impl.keywords == {"decode_kernel": turboquant_decode, "prefill_kernel": turboquant_prefill}


def test_experts_get_the_grouped_gemms():
    assert isinstance(CudaBackend(DEVICE).experts_method(Experts(2, 8, 8)), TritonExperts)


def test_without_triton_the_torch_paths_run():
    backend = CudaBackend(DEVICE)
    backend.triton = False
    assert backend.attention(LayerKVCache(2, 16, 1, 64, torch.bfloat16, DEVICE)) is reference.paged_attention
    assert backend.experts_method(Experts(2, 8, 8)) is Experts.method
    assert "triton is not installed" in backend.describe()[0]


def _only(backend_class):
    """select_backend(device, deterministic) giving `backend_class` on the interpreter's device."""
    return lambda device, deterministic=None: backend_class(device)


def test_engine_greedy_tokens_match_the_reference_backend(tiny_llama, monkeypatch):
    prompts = random_prompts(3, 5, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kwargs = dict(model=tiny_llama, dtype="float32", device=DEVICE.type, max_num_batched_tokens=48,
                  kv_cache_memory=2**20)
    monkeypatch.setattr(worker, "select_backend", _only(ReferenceBackend))
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(worker, "select_backend", _only(CudaBackend))
    llm = LLM(**kwargs)
    assert isinstance(llm.engine.backend, CudaBackend)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_engine_on_turboquant_codes_matches_the_reference_backend(tiny_llama, monkeypatch):
    """tq4 with a 16-bit window: calibration, staging and fresh prompts stay torch's; encoding and attention
    on the codes run in Triton."""
    prompts = random_prompts(2, 20, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kwargs = dict(model=tiny_llama, dtype="float32", device=DEVICE.type, max_num_batched_tokens=32,
                  kv_cache_memory=2**20, kv_cache_dtype="tq4", kv_cache_recent_tokens=8, kv_cache_sink_tokens=2)
    monkeypatch.setattr(worker, "select_backend", _only(ReferenceBackend))
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(worker, "select_backend", _only(CudaBackend))
    llm = LLM(**kwargs)
    assert all(layer.encoder is turboquant_encode for layer in llm.engine.kv_cache.layers)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4_moe"])  # silu experts; gelu-tanh, sliding windows, MQA
def test_engine_on_moe_models_matches_the_reference_backend(family, tmp_path, monkeypatch):
    path = build_moe_checkpoint(str(tmp_path), family)
    prompts = random_prompts(2, 10, 30, seed=5)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    kwargs = dict(model=path, dtype="float32", device=DEVICE.type, max_num_batched_tokens=32, kv_cache_memory=2**20)
    monkeypatch.setattr(worker, "select_backend", _only(ReferenceBackend))
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(worker, "select_backend", _only(CudaBackend))
    got = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    assert got == expected


ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs and memory profiling need a GPU")


@ON_GPU
@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(tiny_llama, dtype, moe, tmp_path):
    """Decode steps replayed from graphs (batches that pad up to a bucket included) give eager's tokens;
    MoE layers too (their expert tiles are listed on the device)."""
    model = tiny_llama if not moe else build_tiny_checkpoint(str(tmp_path), "mixtral", intermediate_size=32,
                                                             num_local_experts=4, num_experts_per_tok=2)
    prompts = random_prompts(5, 5, 60, seed=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kwargs = dict(model=model, dtype=dtype, device="cuda", max_num_seqs=8, kv_cache_memory=2**22)
    expected = [o.outputs[0].token_ids for o in LLM(**kwargs).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**kwargs, enforce_eager=False)
    assert sorted(llm.engine.runner.graphs.graphs) == [1, 2, 4, 8]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


@ON_GPU
def test_gpu_memory_utilization_sizes_the_cache(tiny_llama):
    free, total = torch.cuda.mem_get_info()
    fraction = min(0.95, (total - free) / total + 0.05)  # about 5% of the GPU for this engine
    llm = LLM(tiny_llama, dtype="bfloat16", device="cuda", gpu_memory_utilization=fraction)
    cache_bytes = llm.engine.kv_cache.num_blocks * llm.engine.kv_cache.bytes_per_token * 16
    assert 0 < cache_bytes <= 0.05 * total
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
