"""No host syncs per layer on the CUDA backend: nothing inside a layer waits for the device.

On a GPU, reading a device value on the host (item(), tolist(), nonzero(), a boolean index,
bincount) waits until every kernel queued before it has run, so the next layer's kernels are
not queued ahead and the GPU idles for a launch latency each layer. Off a GPU those reads cost
nothing and cannot be seen by timing, so this counts them: the operations that read the device
on the host, during whole generate() calls of the same model with 2 and with 4 layers. What a
step reads once (the sampled tokens, the plan for the 16-bit window) counts the same in both; a
read inside a layer counts twice as often. Dense caches, a TurboQuant cache with its window, and
MoE layers (grouped Triton GEMMs) are each checked, after a warm-up run that builds the kernels'
tables once.
"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream import LLM, SamplingParams
from slipstream.backends.cuda.backend import CudaBackend
from slipstream.worker import worker
from tests.conftest import build_tiny_checkpoint, random_prompts
from tests.gpu.steps import DEVICE

# what waits for the device: each op below reads a device value (or a size decided by one) on the host
READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
         "aten.bincount.default", "aten.repeat_interleave.Tensor", "aten._unique2.default",
         "aten.unique_consecutive.default", "aten.equal.default", "aten.is_nonzero.default"}
INDEXING = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"}

CASES = {
    "dense": ("llama", {}, {}),
    "turboquant": ("llama", {}, dict(kv_cache_dtype="tq4", kv_cache_recent_tokens=8, kv_cache_sink_tokens=2)),
    "moe": ("mixtral", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2), {}),
}


class HostReads(TorchDispatchMode):
    """Counts host reads of device values by where in slipstream they happen (file:line)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def record(self, what: str) -> None:
        ours = [f for f in traceback.extract_stack() if "/slipstream/" in f.filename]
        where = f"{ours[-1].filename.rsplit('/slipstream/', 1)[-1]}:{ours[-1].lineno}" if ours else "?"
        self.seen[f"{what} at {where}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        masks = args[1] if name in INDEXING and len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        if name in READS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in masks):
            self.record(name)
        return func(*args, **(kwargs or {}))


def host_reads(path: str, layers: int, monkeypatch, **options) -> collections.Counter:
    monkeypatch.setattr(worker, "select_backend", lambda device, deterministic=None: CudaBackend(device))
    llm = LLM(model=path, dtype="float32", device=DEVICE.type, max_num_batched_tokens=24,
              kv_cache_memory=layers * 2**19, **options)  # the same blocks for every depth: the same steps
    prompts = random_prompts(3, 20, 40, seed=4)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: tables built once per kernel and layer
    spy = HostReads()
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (spy.record("tolist"), tolist(self))[1])
    with spy:
        llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return spy.seen


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_host_reads_inside_layers(case, tmp_path, monkeypatch):
    family, shape, options = CASES[case]
    shallow, deep = (host_reads(build_tiny_checkpoint(str(tmp_path / f"layers{n}"), family, num_hidden_layers=n,
                                                      **shape), n, monkeypatch, **options) for n in (2, 4))
    per_layer = {where: (shallow[where], deep[where]) for where in shallow | deep if shallow[where] != deep[where]}
    assert not per_layer, f"host reads inside layers (count at 2 layers, at 4): {per_layer}"
    assert shallow, "no host read seen at all: the spy saw nothing (sampling reads its tokens every step)"
