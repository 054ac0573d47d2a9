"""Mixture of experts: a top-k router, experts as stacked weights, execution grouped by expert.

One `SparseMoeBlock` replaces a dense MLP. The router scores every expert for every token
(linear -> softmax in float32 -> top-k, optionally renormalising the k weights). The
experts' weights are stacked tensors, `gate_up_proj` [E, 2*I, H] and `down_proj` [E, H, I]
(transformers 5's fused layout). Execution is grouped by expert: the (token, expert) pairs
are sorted by expert, each expert runs once on all its tokens, and the weighted outputs
are scatter-added back to their tokens. On a CPU without AMX, large bf16 groups run in float32
(as layers/linear.py does for dense layers), where float32 FMAs outrun bf16 dot products:

- with native kernels built (AVX-512; SiLU experts; H, I multiples of 16), each group of at
  least NATIVE_MIN_TOKENS tokens is one call of kernels/moe_expert.c: gather, gate/up GEMM,
  silu(gate) * up and down GEMM in float32 on weights widened a panel at a time, the weighted
  sums added into one float32 output (no float32 copy of the weights is kept);
- otherwise groups of at least UPCAST_MIN_TOKENS widen the expert's bf16 weights block by
  block into one small reused buffer for MKL's float32 GEMM, and the group's activations stay
  float32 until the weighted sum is rounded back once.

Smaller groups run in bf16 either way. On a CPU with AMX every group of a SiLU expert (H, I
multiples of 32) is one call of the kernel's AMX version: bf16 tiles, the expert's weights
packed for them a panel at a time, silu(gate) * up rounded to bf16 once, the weighted sums
added into one float32 output; it beats oneDNN's AMX kernel on the same expert at every group
size (`native_expert_kernel` holds the choice). Options of the same block cover the families:

- a shared expert that every token passes through, scaled by its own sigmoid gate (Qwen2-MoE);
- Gemma 4's router: the router reads its own input (the pre-norm residual), RMS-normalised
  and scaled, and each expert's weight is multiplied by a learned per-expert scale.

The block counts how many tokens each expert received (`expert_counts`, accumulated until
reset); `load_balance_summary` prints those counts. This module never knows checkpoint
names (models/weights.py stacks per-expert tensors into this layout).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.backends.cpu import abi
from slipstream.layers.linear import Linear, linear, silu_and_mul
from slipstream.layers.mlp import GatedMLP, activation
from slipstream.layers.norm import rms_norm
from slipstream.platform import cpu_has_amx

# Measured on the development machine (AVX512-BF16, no AMX), one expert whose weights come from memory: fp32
# GEMMs plus widening the weights overtake oneDNN's bf16 kernel at 48-64 tokens (1.07x at 64,
# 1.3x at 128), so experts upcast from 64 rows where dense layers (linear.py) wait for 128.
UPCAST_MIN_TOKENS = 64
# kernels/moe_expert.c against the bf16 expert (one thread, Mixtral-shaped experts H=1024 I=2048,
# weights from memory): 1.0x at 8 tokens, 1.4x at 16, 1.6x at 32, 1.8x at 64, so groups of 16
# and more take the kernel, where the torch float32 path needs UPCAST_MIN_TOKENS. Its AMX
# version against the bf16 expert on oneDNN's AMX kernel, same shapes, on the AMX machine
# (GFLOP/s, median of 7): 1 token 8.3 / 6.4, 4: 35 / 25, 16: 92 / 71, 64: 307 / 238, 256:
# 639 / 407, 512: 672 / 535; so every group takes it.
NATIVE_MIN_TOKENS = {"avx512": 16, "amx": 1}
# Weight elements widened at a time into one reused buffer: 2 MiB of fp32 that stays in cache
# for its GEMM, where a whole fp32 copy of each expert is written to memory and read back.
# Measured as fast as or up to 3% faster than whole copies (1 MiB blocks were slower).
WIDEN_BLOCK = 1 << 19

class TopKRouter(nn.Module):
    """Scores -> softmax (float32) -> top-k; returns (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 input_scale: bool = False, per_expert_scale: bool = False, eps: float = 1e-6):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.scale = nn.Parameter(torch.ones(hidden_size)) if input_scale else None
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts)) if per_expert_scale else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scale is not None:  # Gemma 4: normalised input, learned scale, 1/sqrt(H)
            x = rms_norm(x, self.eps) * self.scale * x.shape[-1] ** -0.5
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[ids].float()
        return weights, ids


class Experts(nn.Module):
    """E gated MLPs held as stacked weights, run grouped by expert."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu"):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.act = activation(act)
        self.silu = act == "silu"

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights, ids [T, k]; counts [E] = pairs per expert. Returns [T, H]."""
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)  # pairs grouped by expert, expert 0 first
        token = order // k
        sizes = counts.tolist()  # one host sync per layer, not per expert
        kernel = native_expert_kernel(x, max(sizes), *self.down_proj.shape[1:]) if self.native_fits() else None
        if kernel is not None:
            return self.forward_native(x.contiguous(), weights.flatten()[order].float(), token, sizes, kernel)
        upcast = _upcasts(x) and max(sizes) >= UPCAST_MIN_TOKENS
        xs = (x.float() if upcast else x)[token]
        ys = torch.empty_like(xs)
        buffer = torch.empty(max(WIDEN_BLOCK, *self.gate_up_proj.shape[2:], *self.down_proj.shape[2:])) if upcast else None
        start = 0
        for e, n in enumerate(sizes):
            rows = slice(start, start + n)
            if upcast and n >= UPCAST_MIN_TOKENS:
                self.expert_fp32(e, xs[rows], ys[rows], buffer)
            elif n:
                ys[rows] = self.expert(e, xs[rows].to(x.dtype))
            start += n
        ys.mul_(weights.flatten()[order].unsqueeze(1).to(ys.dtype))
        return x.new_zeros(x.shape, dtype=ys.dtype).index_add_(0, token, ys).to(x.dtype)

    @torch.no_grad()  # inference only: the kernel writes into `out`
    def forward_native(self, x: torch.Tensor, pair_weights: torch.Tensor, token: torch.Tensor,
                       sizes: list[int], kernel: str) -> torch.Tensor:
        """Groups large enough for `kernel` through `native_expert` (float32 sums added into one
        float32 output), smaller ones through `expert` in bf16."""
        out = torch.zeros(x.shape, dtype=torch.float32)
        start = 0
        for e, n in enumerate(sizes):
            rows = slice(start, start + n)
            if n >= NATIVE_MIN_TOKENS[kernel]:
                native_expert(x, token[rows], pair_weights[rows], self.gate_up_proj[e], self.down_proj[e], out, kernel)
            elif n:
                ys = self.expert(e, x[token[rows]]).float().mul_(pair_weights[rows].unsqueeze(1))
                out.index_add_(0, token[rows], ys)
            start += n
        return out.to(x.dtype)

    def native_fits(self) -> bool:
        return self.silu and native_expert_fits(self.gate_up_proj, self.down_proj)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return linear(self.act(gate) * up, self.down_proj[e])

    @torch.no_grad()  # inference only: out= and in-place ops
    def expert_fp32(self, e: int, x: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor) -> None:
        """Expert e on float32 rows x, in float32, written into `out`."""
        h = widened_mm(x, self.gate_up_proj[e], x.new_empty(x.shape[0], self.gate_up_proj.shape[1]), buffer)
        width = h.shape[1] // 2
        gated = h[:, width:].mul_(self.act(h[:, :width]))
        widened_mm(gated, self.down_proj[e], out, buffer)


def widened_mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T for a float32 x and a bf16 weight, widening the weight a block of rows
    at a time into `buffer` (flat float32, at least one row long)."""
    block = buffer.numel() // weight.shape[1]
    for i in range(0, weight.shape[0], block):
        rows = weight[i:i + block]
        wide = buffer[:rows.numel()].view(rows.shape).copy_(rows)
        torch.mm(x, wide.t(), out=out[:, i:i + block])
    return out


def native_expert_fits(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether kernels/moe_expert.c is built and takes these stacked weights: bf16, contiguous,
    H and I multiples of 16 (of 32 for the AMX kernel, see `native_expert_kernel`)."""
    lib = abi.kernels()
    hidden, width = down.shape[-2:]
    laid_out = all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.device.type == "cpu" for w in (gate_up, down))
    return lib is not None and lib.moe_expert_available() == 1 and hidden % 16 == 0 and width % 16 == 0 and laid_out


def native_expert_kernel(x: torch.Tensor, largest_group: int, hidden: int, width: int) -> str | None:
    """Which kernel of kernels/moe_expert.c serves a layer's expert groups of bf16 rows x, the
    largest with `largest_group` tokens, for experts of `hidden` x `width`: "amx" where its
    tiles are usable (H and I multiples of 32), "avx512" on CPUs without AMX (where float32
    FMAs beat bf16 dot products), or None for the torch path (oneDNN bf16, AMX itself)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    if moe_amx_available():
        tiles = hidden % 32 == 0 and width % 32 == 0
        return "amx" if tiles and largest_group >= NATIVE_MIN_TOKENS["amx"] else None
    return "avx512" if _upcasts(x) and largest_group >= NATIVE_MIN_TOKENS["avx512"] else None


def moe_amx_available() -> bool:
    """Whether kernels/moe_expert.c was built with its AMX kernel and this process may use the tiles."""
    lib = abi.kernels()
    return lib is not None and lib.moe_expert_amx_available() == 1


def native_expert(x: torch.Tensor, token: torch.Tensor, pair_weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, out: torch.Tensor, kernel: str = "avx512") -> None:
    """out[token[j]] += pair_weights[j] * down(silu(gate) * up of x[token[j]]), in float32, for one
    expert (gate_up [2I, H], down [H, I]) on bf16 x [T, H] (kernels/moe_expert.c) on `kernel`
    ("avx512": float32 throughout; "amx": bf16 tiles, silu(gate) * up rounded to bf16). `token`
    holds distinct int64 rows; `pair_weights` is float32; `out` is float32 [T, H]."""
    x, token, pair_weights = x.contiguous(), token.contiguous(), pair_weights.float().contiguous()
    hidden, width = down.shape
    run = getattr(abi.kernels(), "moe_expert_silu_amx" if kernel == "amx" else "moe_expert_silu")
    status = run(x.data_ptr(), token.data_ptr(), pair_weights.data_ptr(), token.numel(), gate_up.data_ptr(),
                 down.data_ptr(), out.data_ptr(), hidden, width, abi.threads())
    if status != 0:  # shapes were checked by native_expert_fits; what is left is a failed allocation
        raise MemoryError(f"native MoE expert could not allocate its buffers for {token.numel()} tokens")


def _upcasts(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and not cpu_has_amx()


class SparseMoeBlock(nn.Module):
    """Router + grouped experts (+ optional sigmoid-gated shared expert); counts tokens per expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, act: str = "silu", shared_expert_intermediate_size: int = 0,
                 router_input_scale: bool = False, per_expert_scale: bool = False, eps: float = 1e-6):
        super().__init__()
        self.num_experts = num_experts
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, router_input_scale, per_expert_scale, eps)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, act)
        self.shared_expert = None
        if shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, act)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `router_input` (default x) is what the router scores."""
        weights, ids = self.gate(x if router_input is None else router_input)
        counts = torch.bincount(ids.flatten(), minlength=self.num_experts)
        self.expert_counts += counts
        out = self.experts(x, weights, ids, counts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def reset_counts(self) -> None:
        self.expert_counts.zero_()


def routing_stats(layers: Iterable[nn.Module]) -> dict[int, list[int]]:
    """{decoder layer index: tokens routed to each expert} for every layer whose MLP is a SparseMoeBlock."""
    return {i: block.expert_counts.tolist() for i, block in _moe_blocks(layers)}


def reset_routing_stats(layers: Iterable[nn.Module]) -> None:
    for _, block in _moe_blocks(layers):
        block.reset_counts()


def _moe_blocks(layers: Iterable[nn.Module]) -> Iterator[tuple[int, SparseMoeBlock]]:
    for i, layer in enumerate(layers):
        block = next((m for m in layer.modules() if isinstance(m, SparseMoeBlock)), None)
        if block is not None:
            yield i, block


def load_balance_summary(expert_load: dict[int, list[int]]) -> str:
    """A table: per layer, routed pairs, max/mean and min/mean load (1.00 = perfectly balanced)."""
    lines = ["layer  pairs  max/mean  min/mean  busiest  idle experts"]
    for layer, counts in expert_load.items():
        total = sum(counts)
        mean = total / len(counts)
        if not total:
            lines.append(f"{layer:5d}  {0:5d}         -         -        -  {len(counts)}")
            continue
        busiest = max(range(len(counts)), key=counts.__getitem__)
        lines.append(f"{layer:5d}  {total:5d}  {max(counts) / mean:8.2f}  {min(counts) / mean:8.2f}  "
                     f"{busiest:7d}  {counts.count(0)}")
    return "\n".join(lines)
