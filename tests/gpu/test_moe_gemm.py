"""The Triton grouped expert GEMMs (TritonExperts) against layers/moe.py's torch path (one expert at
a time), on random routings with uneven and empty experts, silu and gelu-tanh, float32 and bf16."""
from __future__ import annotations

import pytest
import torch

from slipstream.backends.cuda.experts import TritonExperts
from slipstream.layers.moe import Experts
from tests.gpu.steps import DEVICE, kernels

# float32: sums in another order; bf16: the reference rounds gate, up, act(gate) * up, each pair's output,
# its weighting and every add of the scatter to bf16, where the kernels keep float32 from the down GEMM
# on: measured up to 0.023 on outputs up to 1.8 (1.5 bf16 ulps there)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def experts_and_routing(num_experts, hidden, inter, tokens, top_k, act, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = Experts(num_experts, hidden, inter, act)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * hidden ** -0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * inter ** -0.5)
    experts = experts.to(DEVICE, dtype)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    # experts 0 and 1 take most pairs (several tiles), the last one none
    scores = torch.rand(tokens, num_experts, generator=g) + torch.linspace(1, 0, num_experts)
    scores[:, -1] = -1
    weights, ids = scores.softmax(-1).topk(top_k, -1)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    return experts, x, weights.to(DEVICE), ids.to(DEVICE), counts.to(DEVICE)


def compare(act="silu", dtype=torch.float32, **shape):
    kernels("moe_gemm")
    args = dict(num_experts=5, hidden=40, inter=72, tokens=37, top_k=2) | shape
    experts, x, weights, ids, counts = experts_and_routing(**args, act=act, dtype=dtype)
    expected = experts(x, weights, ids, counts)
    experts.method = TritonExperts()
    ours = experts(x, weights, ids, counts)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_torch_path(act, dtype):
    compare(act, dtype)


def test_one_token_and_top_one():
    compare(tokens=1, top_k=1)
    compare(tokens=3, top_k=4)


def test_tiles_never_mix_experts():
    """Listed on the device, as many as the bound gives: the real tiles, then empty ones (end = first)."""
    kernel = kernels("moe_gemm")
    m = kernel.BLOCK_M
    counts = [0, m + 1, 3, 0, m]
    tiles = kernel.expert_tiles(torch.tensor(counts, device=DEVICE), sum(counts)).tolist()
    real = [[1, 0, m + 1], [1, m, m + 1], [2, m + 1, m + 4], [4, m + 4, 2 * m + 4]]
    assert tiles[:4] == real and len(tiles) == 3 + len(counts)  # ceil((2m + 4) / m) + 5 experts
    assert all(first == end for _, first, end in tiles[4:])
    few = kernel.expert_tiles(torch.tensor([1, 0, 2], device=DEVICE), 3).tolist()  # never more tiles than pairs
    assert few[:2] == [[0, 0, 1], [2, 1, 3]] and few[2][1] == few[2][2]


def test_unknown_activation_is_named():
    kernel = kernels("moe_gemm")
    w = torch.zeros(1, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="'relu' has no kernel"):
        kernel.grouped_experts(torch.zeros(1, 2, device=DEVICE), w, w.transpose(1, 2).contiguous(),
                               torch.zeros(1, dtype=torch.long, device=DEVICE), torch.ones(1, device=DEVICE),
                               torch.ones(1, dtype=torch.long, device=DEVICE), "relu")
