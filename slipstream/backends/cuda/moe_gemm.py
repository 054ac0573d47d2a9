"""The MoE expert-grouped GEMMs in Triton: fused gate/up + activation, then down with the routing weight.

Owns: two kernels over the (token, expert) pairs sorted by expert (layers/moe.py's
ExpertGroups). A program takes BLOCK_M pairs of one expert (a tile never mixes experts; the
tiles are listed on the device from the pairs per expert) and BLOCK_N output columns:
`_gate_up` gathers its tokens' rows of x and writes act(x W_gate^T) * (x W_up^T) per pair in
the model dtype; `_down` writes (h W_down^T) * weight per pair in float32. Must never know
routers, checkpoints or models; layers/moe.py's torch path is the reference.

The pairs' rows are then summed per token in a fixed order (backends/cuda/experts.py), not
scattered with atomics: atomic adds would make a token's sum depend on which program ran
first, and outputs must not depend on the batch.

This module imports triton at import time: import it lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.backends.cuda.paged_attention import _dot, interpreted

ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # layers/mlp.py's names
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _activate(g, ACT: tl.constexpr):
    if ACT == 0:
        y = g * tl.sigmoid(g)
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) * (g + 0.044715 g^3)
        y = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))  # tanh(u) = 2 sigmoid(2u) - 1
    return y


@triton.jit
def _tile(tiles, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's expert, its pairs and which of them are real, and its output columns, those past
    `width` masked (all of them in an empty tile: it reads no weights)."""
    expert = tl.load(tiles + 3 * tl.program_id(0))
    first = tl.load(tiles + 3 * tl.program_id(0) + 1)
    end = tl.load(tiles + 3 * tl.program_id(0) + 2)
    pairs = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pairs, pairs < end, cols, cols < tl.where(first < end, width, 0)


@triton.jit
def _gate_up(x, weight, tiles, token, out, hidden, inter, stride_xt, stride_we, stride_wn, stride_ot,
             ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             INTERPRETED: tl.constexpr):
    expert, pairs, pair_ok, cols, col_ok = _tile(tiles, inter, BLOCK_M, BLOCK_N)
    rows = tl.load(token + pairs, mask=pair_ok, other=0)
    w = weight + expert.to(tl.int64) * stride_we
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x + rows[:, None] * stride_xt + k[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(w + cols[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w + (cols + inter)[None, :] * stride_wn + k[:, None], mask=wmask, other=0.0)
        gate += _dot(a, wg, INTERPRETED)
        up += _dot(a, wu, INTERPRETED)
    h = _activate(gate.to(out.dtype.element_ty).to(tl.float32), ACT) * up.to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + pairs[:, None] * stride_ot + cols[None, :], h.to(out.dtype.element_ty),
             mask=pair_ok[:, None] & col_ok[None, :])


@triton.jit
def _down(h, weight, tiles, pair_weights, out, hidden, inter, stride_ht, stride_we, stride_wn, stride_ot,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    expert, pairs, pair_ok, cols, col_ok = _tile(tiles, hidden, BLOCK_M, BLOCK_N)
    w = weight + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(h + pairs[:, None] * stride_ht + k[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        wd = tl.load(w + cols[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += _dot(a, wd, INTERPRETED)
    scale = tl.load(pair_weights + pairs, mask=pair_ok, other=0.0)
    tl.store(out + pairs[:, None] * stride_ot + cols[None, :], acc * scale[:, None],
             mask=pair_ok[:, None] & col_ok[None, :])


def expert_tiles(counts: torch.Tensor, pairs: int) -> torch.Tensor:
    """int32 [tiles, 3]: (expert, first pair, end of the expert's pairs) per BLOCK_M pairs of one expert, from
    the pairs per expert, built on the device. How many tiles there are is not known on the host without
    waiting for the counts, so there are as many rows as a bound gives (a tile holds at least one of the
    `pairs`; each expert adds at most one partial tile) and the rows past the real tiles are empty
    (end = first): their programs load and store nothing."""
    bound = min(pairs, triton.cdiv(pairs, BLOCK_M) + len(counts))
    ends = counts.cumsum(0)
    per_expert = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_to = per_expert.cumsum(0)
    tile = torch.arange(bound, device=counts.device)
    expert = torch.searchsorted(tiles_to, tile, right=True)  # the first expert whose tiles reach past `tile`
    real = expert < len(counts)
    expert = expert.clamp_max(len(counts) - 1)
    first = ends[expert] - counts[expert] + (tile - tiles_to[expert] + per_expert[expert]) * BLOCK_M
    return torch.stack([expert, first, torch.where(real, ends[expert], first)], 1).to(torch.int32)


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, token: torch.Tensor,
                    pair_weights: torch.Tensor, counts: torch.Tensor, act: str) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; the pairs sorted by expert (token [P], weights [P]
    float32, counts [E] pairs per expert). Returns each pair's weighted expert output [P, H] in float32."""
    if act not in ACTIVATIONS:
        raise ValueError(f"grouped experts: activation {act!r} has no kernel; allowed: {sorted(ACTIVATIONS)}")
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("grouped experts: x and the expert weights need unit stride along their last dim")
    pairs, (hidden, inter) = len(token), down.shape[1:]
    tiles = expert_tiles(counts, pairs)
    h = x.new_empty((pairs, inter))
    out = x.new_empty((pairs, hidden), dtype=torch.float32)
    if not len(tiles):
        return out
    interp = interpreted()
    _gate_up[(len(tiles), triton.cdiv(inter, BLOCK_N))](
        x, gate_up, tiles, token, h, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        ACT=ACTIVATIONS[act], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, INTERPRETED=interp)
    _down[(len(tiles), triton.cdiv(hidden, BLOCK_N))](
        h, down, tiles, pair_weights, out, hidden, inter, h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, INTERPRETED=interp)
    return out
