"""The native MoE expert (kernels/moe_expert.c) against a float32 computation from the same bf16
weights: tile tails in tokens and features, accumulation into the output, the MoE layer on the
CPU backend's expert method.

Every kernel the machine can run is tested, in every ISA build with a path for it: the AVX-512
one (float32 throughout: only the order of the sums differs, tolerance 1e-4) and, where the
capability says AMX tiles are usable, the AMX one (bf16 tiles,
float32 sums, silu(gate) * up rounded to bf16 once before the down projection: a relative
error up to 2^-9 per activation, tolerance 1e-2)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.backends.cpu import abi, moe
from slipstream.backends.cpu.backend import CpuBackend
from slipstream.backends.cpu.capability import CpuCapability
from slipstream.backends.cpu.moe import NATIVE_MIN_TOKENS, CpuExperts, native_expert
from slipstream.layers.moe import Experts

@pytest.fixture
def expert_isa(isa) -> str:
    """`isa` where its moe_expert.c has a path (AVX-512); builds without one keep the torch experts."""
    if not abi.kernels().moe_expert_available():
        pytest.skip(f"moe_expert.c has no {isa} path (it needs AVX-512); the torch experts run there")
    return isa


@pytest.fixture(params=["avx512", "amx"])
def kernel(request, expert_isa) -> str:
    """Each kernel of the build under test that this machine runs."""
    if request.param == "amx" and not CpuCapability.detect().amx_kernels:
        pytest.skip(f"the {expert_isa} build has no AMX expert kernel on this machine")
    return request.param


TOLERANCE = {"avx512": 1e-4, "amx": 1e-2}


def expert_weights(hidden: int, width: int, seed: int, scale: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(2 * width, hidden, generator=g) * scale).bfloat16()
    down = (torch.randn(hidden, width, generator=g) * scale).bfloat16()
    return gate_up, down


def reference(x, token, pair_weights, gate_up, down, out):
    """out[token] += w * down(silu(gate) * up), float32 from the bf16 inputs."""
    gate, up = (x[token].float() @ gate_up.float().T).chunk(2, dim=-1)
    return out.index_add(0, token, pair_weights.unsqueeze(1) * ((F.silu(gate) * up) @ down.float().T))


# AVX-512: panels hold 144 features (72 gate + 72 up rows). hidden 160 = 144 + 16: a last down
# panel of two 6-row tiles and one of 4; width 80 = 72 + 8 and 160 = 2 x 72 + 16: last gate/up
# panels ending in a tile of 2 and of 1 gate row(s). Tokens: one, 15/16/17 around a vector,
# 63/64/65 around a block of 64, and 130 = two full blocks and a last block of 2. AMX (H and I
# multiples of 32): blocks of 32 tokens (one, 15/16/17 around a row tile, 63/64/65 around two
# blocks), hidden 96 and 160 end the down pass in a single 16-column block.
SHAPES = {"avx512": [(48, 48), (160, 80), (32, 160)], "amx": [(32, 160), (96, 64), (160, 32)]}


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 63, 64, 65, 130])
@pytest.mark.parametrize("shape", range(3))
def test_expert_equals_float32_computation(kernel, tokens, shape):
    hidden, width = SHAPES[kernel][shape]
    gate_up, down = expert_weights(hidden, width, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(200, hidden, generator=g).bfloat16()
    token = torch.randperm(200, generator=g)[:tokens]
    pair_weights = torch.rand(tokens, generator=g)
    out = torch.randn(200, hidden, generator=g)  # the kernel adds into what is there
    expected = reference(x, token, pair_weights, gate_up, down, out)
    native_expert(x, token, pair_weights, gate_up, down, out, kernel)
    tolerance = TOLERANCE[kernel]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def test_silu_of_huge_gates_saturates(kernel):
    """Gates of +-1e20: silu(g) = g or 0. Unclamped, the kernel's exp would reduce such arguments
    to garbage and turn silu(1e20) into 0. Up rows are as small, so that products stay finite."""
    hidden, width = 32, 32
    gate_up, down = expert_weights(hidden, width, seed=1, scale=1.0)
    gate_up = torch.cat([gate_up[:width].float() * 1e20, gate_up[width:].float() * 1e-20]).bfloat16()
    x = torch.randn(70, hidden).bfloat16()
    token, pair_weights = torch.arange(70), torch.ones(70)
    out = torch.zeros(70, hidden)
    expected = reference(x, token, pair_weights, gate_up, down, torch.zeros(70, hidden))
    native_expert(x, token, pair_weights, gate_up, down, out, kernel)
    assert torch.isfinite(expected).all() and expected.abs().max() > 1
    tolerance = TOLERANCE[kernel]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


def moe_inputs(num_experts: int, hidden: int, width: int, tokens: int, top_k: int, bias: list[float] | None = None):
    torch.manual_seed(0)
    experts = Experts(num_experts, hidden, width).bfloat16()
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
    x = torch.randn(tokens, hidden).bfloat16()
    scores = torch.randn(tokens, num_experts) + torch.tensor(bias or [0.0] * num_experts)
    weights, ids = scores.softmax(-1).topk(top_k)
    return experts, x, weights, ids, torch.bincount(ids.flatten(), minlength=num_experts)


def moe_reference(experts, x, weights, ids):
    out = torch.zeros(x.shape)
    for e in range(experts.gate_up_proj.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if len(token):
            out = reference(x, token, weights[token, slot], experts.gate_up_proj[e], experts.down_proj[e], out)
    return out


@pytest.mark.parametrize("bias", [
    [0.0] * 4,
    [0.0, 0.0, 100.0, 0.0],  # expert 2 is every token's first choice
    [0.0, 0.0, 0.0, -100.0, -1.5, 0.0],  # expert 3 gets no token, expert 4 a few (12)
], ids=["spread", "one-expert-takes-all", "empty-and-small-experts"])
def test_moe_layer_runs_large_groups_natively(monkeypatch, bias, kernel):
    """bf16, on each kernel as the CPU backend binds it (the AVX-512 one as a CPU without AMX
    would): groups of >= NATIVE_MIN_TOKENS go through the kernel, smaller ones through the bf16
    expert; the sum matches float32 up to bf16 rounding."""
    calls = []

    def recorded(x, token, *rest):
        calls.append((len(token), rest[-1]))
        native_expert(x, token, *rest)

    monkeypatch.setattr(moe, "native_expert", recorded)
    experts, x, weights, ids, counts = moe_inputs(len(bias), 32, 64, 150, 2, bias)
    experts.method = CpuExperts(kernel, upcast=kernel == "avx512")
    with torch.no_grad():
        out = experts(x, weights, ids, counts)
    sizes = counts.tolist()
    assert calls == [(n, kernel) for n in sizes if n >= NATIVE_MIN_TOKENS[kernel]]
    if max(bias) > 0:
        assert max(sizes) == 150
    if min(bias) < 0:
        assert sizes[3] == 0 and 0 < sizes[4] < NATIVE_MIN_TOKENS["avx512"], sizes  # a group the AVX-512 kernel skips
    expected = moe_reference(experts, x, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.02 * expected.abs().max().item())


@pytest.mark.parametrize("amx", [False, True])
def test_without_native_kernels_the_torch_path_runs(no_native_kernels, monkeypatch, amx):
    """No kernels: the backend binds the torch experts, in float32 for large groups where a
    CPU without AMX would want it."""
    monkeypatch.setattr(moe, "native_expert", lambda *a: pytest.fail("native kernel called with kernels disabled"))
    capability = CpuCapability.detect()
    flags = capability.flags | {"amx_bf16", "amx_tile"} if amx else capability.flags - {"amx_bf16", "amx_tile"}
    experts, x, weights, ids, counts = moe_inputs(4, 32, 48, 150, 2)
    method = CpuBackend(CpuCapability(flags, None, capability.isa, "off")).experts_method(experts)
    assert method.kernel is None and method.upcast == (not amx)
    experts.method = method
    with torch.no_grad():
        out = experts(x, weights, ids, counts)
    expected = moe_reference(experts, x, weights, ids)
    torch.testing.assert_close(out.float(), expected, rtol=0.02, atol=0.02 * expected.abs().max().item())


def test_threads_split_the_panels_without_changing_the_result(kernel):
    """Two threads take alternate panels of each GEMM (and the token blocks of the packing)."""
    hidden, width = 160, 160  # two or three panels of each GEMM
    gate_up, down = expert_weights(hidden, width, seed=3)
    x = torch.randn(300, hidden).bfloat16()
    token, pair_weights = torch.randperm(300)[:200], torch.rand(200)
    expected = reference(x, token, pair_weights, gate_up, down, torch.zeros(300, hidden))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = torch.zeros(300, hidden)
        native_expert(x, token, pair_weights, gate_up, down, out, kernel)
    finally:
        torch.set_num_threads(threads)
    tolerance = TOLERANCE[kernel]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
