"""The CPU backend's MoE expert methods: native expert kernels, and float32 for large groups.

On a CPU without AMX, large bf16 groups run in float32 (as backends/cpu/linear.py does for
dense layers), where float32 FMAs outrun bf16 dot products:

- with native kernels built (AVX-512; SiLU experts; H, I multiples of 16), each group of at
  least NATIVE_MIN_TOKENS tokens is one call of kernels/moe_expert.c: gather, gate/up GEMM,
  silu(gate) * up and down GEMM in float32 on weights widened a panel at a time, the weighted
  sums added into one float32 output (no float32 copy of the weights is kept);
- otherwise groups of at least UPCAST_MIN_TOKENS widen the expert's bf16 weights block by
  block into one small reused buffer for MKL's float32 GEMM, and the group's activations stay
  float32 until the weighted sum is rounded back once.

Smaller groups run in bf16 either way. Where bf16 dot products outrun float32 FMAs (AMD Zen 4:
`CpuCapability.bf16_dots_win`), every group runs in bf16 on oneDNN, the kernel only where
batch invariance needs it (backend.py). On a CPU with AMX every group of a SiLU expert (H, I
multiples of 32) is one call of the kernel's AMX version: bf16 tiles, the expert's weights
packed for them a panel at a time, silu(gate) * up rounded to bf16 once, the weighted sums
added into one float32 output; it beats oneDNN's AMX kernel on the same expert at every group
size. Without a fitting kernel, AMX CPUs keep the bf16 experts (oneDNN uses the tiles).

Batch invariance (`invariant`): every group, whatever its size, takes the kernel, whose rows'
sums do not depend on the rows beside them; a token's expert outputs are added in expert
order into float32. Experts the kernel cannot take are not invariant (`serves` says so).
"""
from __future__ import annotations

import torch

from slipstream.backends.cpu import abi
from slipstream.layers.moe import ExpertGroups, Experts, ExpertsMethod

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



class CpuExperts(ExpertsMethod):
    """`kernel` ("amx", "avx512" or None): the moe_expert.c kernel this CPU runs; `upcast`:
    large bf16 groups without a kernel go through float32 (CPUs without AMX); `invariant`:
    every group through the kernel."""

    def __init__(self, kernel: str | None, upcast: bool, invariant: bool = False):
        self.kernel, self.upcast = kernel, upcast
        self.min_tokens = dict.fromkeys(NATIVE_MIN_TOKENS, 1) if invariant else NATIVE_MIN_TOKENS

    def serves(self, experts: Experts) -> bool:
        """Whether the kernel takes these experts (SiLU, shapes it tiles)."""
        return experts.silu and native_expert_fits(experts, self.kernel)

    def apply(self, experts: Experts, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            return super().apply(experts, x, groups)
        largest = max(groups.sizes)
        kernel = self.kernel if self.serves(experts) else None
        if kernel is not None and largest >= self.min_tokens[kernel]:
            return self.native(experts, x.contiguous(), groups, kernel)
        if self.upcast and largest >= UPCAST_MIN_TOKENS:
            return self.float32(experts, x, groups)
        return super().apply(experts, x, groups)

    @torch.no_grad()  # inference only: the kernel writes into `out`
    def native(self, experts: Experts, x: torch.Tensor, groups: ExpertGroups, kernel: str) -> torch.Tensor:
        """Groups large enough for `kernel` through `native_expert` (float32 sums added into one
        float32 output), smaller ones through the expert in bf16."""
        out, start = torch.zeros(x.shape, dtype=torch.float32), 0
        for e, n in enumerate(groups.sizes):
            token, pair_weights = groups.token[start:start + n], groups.pair_weights[start:start + n]
            if n >= self.min_tokens[kernel]:
                native_expert(x, token, pair_weights, experts.gate_up_proj[e], experts.down_proj[e], out, kernel)
            elif n:
                out.index_add_(0, token, experts.expert(e, x[token]).float().mul_(pair_weights.unsqueeze(1)))
            start += n
        return out.to(x.dtype)

    @torch.no_grad()  # inference only: out= and in-place ops
    def float32(self, experts: Experts, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Groups of UPCAST_MIN_TOKENS and more in float32 on weights widened block by block,
        smaller ones in bf16; the weighted sum rounded back once."""
        xs = x.float()[groups.token]
        ys = torch.empty_like(xs)
        buffer = torch.empty(max(WIDEN_BLOCK, *experts.gate_up_proj.shape[2:], *experts.down_proj.shape[2:]))
        start = 0
        for e, n in enumerate(groups.sizes):
            rows = slice(start, start + n)
            if n >= UPCAST_MIN_TOKENS:
                h = widened_mm(xs[rows], experts.gate_up_proj[e], xs.new_empty(n, experts.gate_up_proj.shape[1]), buffer)
                width = h.shape[1] // 2
                widened_mm(h[:, width:].mul_(experts.act(h[:, :width])), experts.down_proj[e], ys[rows], buffer)
            elif n:
                ys[rows] = experts.expert(e, xs[rows].to(x.dtype))
            start += n
        ys.mul_(groups.pair_weights.unsqueeze(1))
        return xs.new_zeros(x.shape).index_add_(0, groups.token, ys).to(x.dtype)


def widened_mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """out = x @ weight.T for a float32 x and a bf16 weight, widening the weight a block of rows
    at a time into `buffer` (flat float32, at least one row long)."""
    block = buffer.numel() // weight.shape[1]
    for i in range(0, weight.shape[0], block):
        rows = weight[i:i + block]
        wide = buffer[:rows.numel()].view(rows.shape).copy_(rows)
        torch.mm(x, wide.t(), out=out[:, i:i + block])
    return out


def native_expert_fits(experts: Experts, kernel: str | None) -> bool:
    """Whether `kernel` of kernels/moe_expert.c takes these stacked weights: bf16, contiguous
    on the CPU, H and I multiples of 16 (of 32 for the AMX kernel)."""
    hidden, width = experts.down_proj.shape[-2:]
    multiple = 32 if kernel == "amx" else 16
    laid_out = all(w.dtype == torch.bfloat16 and w.is_contiguous() and w.device.type == "cpu"
                   for w in (experts.gate_up_proj, experts.down_proj))
    return kernel is not None and hidden % multiple == 0 and width % multiple == 0 and laid_out


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
