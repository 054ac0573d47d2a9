"""The MoE layer against direct computations: routing, grouped execution, counters."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.backends.cpu import moe as cpu_moe
from slipstream.backends.cpu.moe import CpuExperts
from slipstream.layers.moe import SparseMoeBlock, TopKRouter, load_balance_summary

H, I = 16, 24


def make_block(num_experts=4, top_k=2, seed=0, **options) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(H, I, num_experts, top_k, **options)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + (1.0 if p.dim() == 1 else 0.0))  # 1-d: scales around 1
    return block


def direct_route(router: TopKRouter, x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k by sorting each token's probabilities in Python."""
    if router.scale is not None:
        x = x / x.pow(2).mean(-1, keepdim=True).add(router.eps).sqrt() * router.scale / math.sqrt(x.shape[-1])
    ids, weights = [], []
    for row in (x @ router.weight.T).softmax(-1).tolist():
        best = sorted(range(len(row)), key=lambda e: -row[e])[:router.top_k]
        w = [row[e] for e in best]
        if router.renormalize:
            w = [v / sum(w) for v in w]
        if router.per_expert_scale is not None:
            w = [v * router.per_expert_scale[e].item() for v, e in zip(w, best)]
        ids.append(best)
        weights.append(w)
    return ids, weights


def direct_forward(block: SparseMoeBlock, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: the weighted sum of its k experts (+ the gated shared expert)."""
    ids, weights = direct_route(block.gate, x if router_input is None else router_input)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    rows = []
    for t in range(x.shape[0]):
        out = torch.zeros(H)
        for e, w in zip(ids[t], weights[t]):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out += w * (down[e] @ (F.silu(gate) * up))
        if block.shared_expert is not None:
            out += torch.sigmoid(block.shared_expert_gate.weight @ x[t]) * block.shared_expert(x[t:t + 1])[0]
        rows.append(out)
    return torch.stack(rows)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("gemma", [False, True], ids=["plain", "gemma-scales"])
def test_router_topk_and_weights_match_direct_computation(renormalize, gemma):
    block = make_block(num_experts=6, top_k=3, renormalize=renormalize, router_input_scale=gemma, per_expert_scale=gemma)
    x = torch.randn(40, H)
    weights, ids = block.gate(x)
    expected_ids, expected_weights = direct_route(block.gate, x)
    assert ids.tolist() == expected_ids
    assert torch.allclose(weights, torch.tensor(expected_weights), atol=1e-6)
    if renormalize and not gemma:
        assert torch.allclose(weights.sum(-1), torch.ones(40))


@pytest.mark.parametrize("options", [
    dict(renormalize=True),
    dict(renormalize=False, shared_expert_intermediate_size=20),
    dict(renormalize=True, router_input_scale=True, per_expert_scale=True),
], ids=["mixtral", "qwen2-shared-expert", "gemma4-router"])
def test_grouped_execution_matches_token_by_token(options):
    block = make_block(num_experts=5, top_k=2, **options)
    x = torch.randn(33, H)
    router_input = torch.randn(33, H) if options.get("router_input_scale") else None
    with torch.no_grad():
        out = block(x, router_input=router_input)
        expected = direct_forward(block, x, router_input)
    assert torch.allclose(out, expected, atol=1e-5), (out - expected).abs().max()


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 40), num_experts=st.integers(1, 9), data=st.data())
def test_counts_and_distinct_experts(tokens, num_experts, data):
    top_k = data.draw(st.integers(1, num_experts))
    block = make_block(num_experts=num_experts, top_k=top_k, seed=tokens, renormalize=True)
    x = torch.randn(tokens, H)
    with torch.no_grad():
        _, ids = block.gate(x)
        out = block(x)
    assert all(len(set(row)) == top_k for row in ids.tolist())  # never the same expert twice for a token
    assert block.expert_counts.sum().item() == tokens * top_k
    assert block.expert_counts.tolist() == torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    assert torch.allclose(out, direct_forward(block, x), atol=1e-5)


def test_bf16_large_groups_run_in_float32(monkeypatch):
    """bf16 without AMX or native kernels: groups of >= UPCAST_MIN_TOKENS run in fp32 (weights widened
    in blocks of rows, the last one partial), smaller ones in bf16; both match a float32 computation.
    (tests/kernels/test_moe_expert.py covers the native kernel.)"""
    monkeypatch.setattr(cpu_moe, "UPCAST_MIN_TOKENS", 30)
    monkeypatch.setattr(cpu_moe, "WIDEN_BLOCK", 5 * I)  # gate_up [48, 16]: blocks of 7 rows; down [16, 24]: 5
    block = make_block(num_experts=4, top_k=2, renormalize=True).to(torch.bfloat16)
    block.experts.method = CpuExperts(kernel=None, upcast=True)
    widened, widened_mm = [], cpu_moe.widened_mm
    monkeypatch.setattr(cpu_moe, "widened_mm", lambda x, w, *a: widened.append(w.data_ptr()) or widened_mm(x, w, *a))
    x = torch.randn(60, H, dtype=torch.bfloat16)
    with torch.no_grad():
        weights, ids = block.gate(x)
        counts = torch.bincount(ids.flatten(), minlength=4)
        out = block.experts(x, weights, ids, counts)
    upcast = [e for e, n in enumerate(counts.tolist()) if n >= 30]
    assert 0 < len(upcast) < 4 and widened == [p for e in upcast for p in (block.experts.gate_up_proj[e].data_ptr(),
                                                                          block.experts.down_proj[e].data_ptr())]
    gate_up, down = block.experts.gate_up_proj.float(), block.experts.down_proj.float()
    expected = torch.zeros(60, H)
    for t, (token_ids, token_weights) in enumerate(zip(ids.tolist(), weights)):
        for e, w in zip(token_ids, token_weights):
            gate, up = (gate_up[e] @ x[t].float()).chunk(2)
            expected[t] += w * (down[e] @ (F.silu(gate) * up))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, rtol=0.02, atol=0.02 * expected.abs().max().item()), \
        (out.float() - expected).abs().max()


def test_counts_accumulate_until_reset():
    block = make_block(renormalize=True)
    with torch.no_grad():
        block(torch.randn(7, H))
        block(torch.randn(5, H))
    assert block.expert_counts.sum().item() == (7 + 5) * 2
    block.reset_counts()
    assert block.expert_counts.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_receiving_every_token(top_k):
    block = make_block(num_experts=4, top_k=top_k, renormalize=True)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[2] = 10.0  # inputs are positive: expert 2 wins for every token
    x = torch.rand(50, H) + 0.1
    with torch.no_grad():
        out = block(x)
    assert block.expert_counts[2].item() == 50
    assert block.expert_counts.sum().item() == 50 * top_k
    assert torch.allclose(out, direct_forward(block, x), atol=1e-5)


def test_load_balance_summary():
    text = load_balance_summary({0: [30, 10, 0, 0], 3: [10, 10, 10, 10]})
    rows = [line.split() for line in text.splitlines()[1:]]
    assert rows[0] == ["0", "40", "3.00", "0.00", "0", "2"]
    assert rows[1] == ["3", "40", "1.00", "1.00", "0", "0"]
