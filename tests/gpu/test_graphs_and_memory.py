"""What CPU-only runs can check of CUDA graphs and gpu_memory_utilization: bucket choice, the graphs'
input buffers after a step is copied in (padding into the scratch block), the arithmetic of the KV
budget, and the errors a user gets. Capture and replay themselves need a GPU (benchmarks/gpu.sh)."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM
from slipstream.backends.cuda.graphs import DecodeGraphs, bucket_for, capture_sizes, graph_blockers
from slipstream.backends.cuda.memory import GiB, kv_cache_budget
from slipstream.config import EngineConfig
from tests.gpu.steps import random_step


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(20)
    assert [bucket_for(b, sizes) for b in (1, 3, 4, 5, 17, 20, 21)] == [1, 4, 4, 8, 20, 20, None]
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        capture_sizes(0)


def test_a_decode_step_fills_the_graph_inputs_and_pads_into_the_scratch_block():
    graphs = DecodeGraphs(max_num_seqs=8, max_blocks_per_seq=6, block_size=4, max_model_len=24, scratch_block=29,
                          device=torch.device("cpu"))
    meta = random_step([(1, 9), (1, 4), (1, 17)], 4, 29)
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([8, 3, 16])
    assert graphs.fill(ids, positions, meta) == 4
    assert graphs.input_ids[:4].tolist() == [5, 6, 7, 0] and graphs.positions[:4].tolist() == [8, 3, 16, 0]
    assert graphs.slot_mapping[:4].tolist() == meta.slot_mapping.tolist() + [29 * 4]
    assert graphs.seq_lens[:4].tolist() == [9, 4, 17, 1]
    width = meta.block_table.shape[1]
    assert torch.equal(graphs.block_table[:3, :width], meta.block_table) and graphs.block_table[3, 0] == 29
    capture = graphs.metadata(4)
    assert capture.num_decodes == 4 and capture.context_lens == [24] * 4  # split-KV chosen for the longest context
    assert capture.query_start_loc.tolist() == [0, 1, 2, 3, 4]


def test_steps_without_a_graph_are_declined():
    graphs = DecodeGraphs(4, 6, 4, 24, 29, torch.device("cpu"))
    prefill = random_step([(1, 9), (3, 4)], 4, 29)
    assert graphs.fill(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), prefill) is None
    wide = random_step([(1, 9)] * 5, 4, 29)
    assert graphs.fill(torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), wide) is None
    decode = random_step([(1, 9)], 4, 29)
    assert graphs.replay(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), decode) is None  # not captured


def test_graph_blockers_say_why():
    cpu = torch.device("cpu")
    assert graph_blockers(torch.device("cuda"), True, False) == []
    reasons = graph_blockers(cpu, False, True)
    assert len(reasons) == 3 and "CUDA device, not cpu" in reasons[0]


def test_kv_cache_budget():
    assert kv_cache_budget(0.9, 100 * GiB, 20 * GiB, 5 * GiB, 8192) == int(0.9 * 100 * GiB) - 25 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2 leaves no memory.*8192-token step"):
        kv_cache_budget(0.2, 100 * GiB, 18 * GiB, 5 * GiB, 8192)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "0.9"])
def test_gpu_memory_utilization_is_validated(value):
    with pytest.raises(ValueError, match=f"gpu_memory_utilization={value!r} must be None or a fraction"):
        EngineConfig.from_kwargs(gpu_memory_utilization=value)


def test_enforce_eager_is_validated():
    with pytest.raises(ValueError, match="enforce_eager=1 must be True or False"):
        EngineConfig.from_kwargs(enforce_eager=1)


def test_cpu_engines_refuse_graphs_and_gpu_memory_utilization(tiny_llama):
    with pytest.raises(ValueError, match="enforce_eager=False needs CUDA graphs.*cpu"):
        LLM(tiny_llama, dtype="float32", device="cpu", enforce_eager=False, kv_cache_memory=2**20)
    with pytest.raises(ValueError, match="gpu_memory_utilization applies to CUDA devices"):
        LLM(tiny_llama, dtype="float32", device="cpu", gpu_memory_utilization=0.5)
