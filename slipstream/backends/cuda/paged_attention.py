"""Paged attention in Triton for mixed batches: decode rows and prefill chunks over a cached prefix.

Owns: one kernel over a whole step (varlen through query_start_loc, GQA/MQA by tiling the
query heads that share a KV head together, sliding windows, any head size, bf16 / fp16 /
fp32 / fp8-e4m3 caches), its split-KV variant for long contexts and the reduction that
merges the splits. Must never know models, schedulers or how the cache was written: it reads
a head-major cache [Hk, num_blocks, block_size, D] through block tables, nothing else.

A program takes BLOCK_M query tokens of one sequence times the G query heads of one KV
head (BLOCK_M * G rows, so that tl.dot has at least 16 rows even for decode) and walks the
KV tokens that those queries can see in tiles of BLOCK_N, with an online softmax in
float32. Programs are numbered per sequence as query_start_loc[b] // BLOCK_M + b onward, an
upper bound on the tiles before row b, so the grid depends only on the numbers of tokens
and rows (no host pass over the batch, which a CUDA graph could not replay); a program
finds its row by binary search and exits if it has no queries. With NUM_SPLITS > 1 each
program covers one slice of its KV range and writes an unnormalised partial result that
`_merge_splits` combines.

This module imports triton at import time: import it lazily (TRITON_INTERPRET must be set
before the kernels are decorated, tests/gpu/conftest.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # scores in log2 units, for exp2
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on the GPU
SPLIT_MIN_CONTEXT = 2048  # shorter contexts: one program's walk is short enough
SPLIT_TARGET_PROGRAMS = 256  # about two waves on an H100/H200 (132 SMs)
MAX_SPLITS = 16


@triton.jit
def _find_row(query_start_loc, pid, num_rows, BLOCK_M: tl.constexpr):
    """The row b whose programs (from query_start_loc[b] // BLOCK_M + b) include pid."""
    # typed: loop-carried values must keep one type, and Triton passes num_rows == 1 as a constant
    lo: tl.int32 = 0
    hi: tl.int32 = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc + mid + 1).to(tl.int32) // BLOCK_M + mid + 1
        if first <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _paged_attention(q, k_cache, v_cache, out, part_acc, part_max, part_sum,
                     block_table, seq_lens, query_start_loc, num_rows, scale, window,
                     stride_qt, stride_qh, stride_ot, stride_oh,
                     stride_ch, stride_cb, stride_ct, stride_bt,
                     G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = _find_row(query_start_loc, pid, num_rows, BLOCK_M)
    q_begin = tl.load(query_start_loc + row).to(tl.int32)
    q_end = tl.load(query_start_loc + row + 1).to(tl.int32)
    tile_start = q_begin + (pid - (q_begin // BLOCK_M + row)) * BLOCK_M
    if tile_start >= q_end:
        return
    context_len = tl.load(seq_lens + row).to(tl.int32)
    first_pos = context_len - (q_end - q_begin)  # position of the row's first query

    rows = tl.arange(0, BLOCK_M * G_PAD)
    token = tile_start + rows // G_PAD
    head = kv_head * G + rows % G_PAD
    row_ok = (token < q_end) & (rows % G_PAD < G)
    qpos = first_pos + token - q_begin
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    qv = tl.load(q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                 mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # the KV positions these queries may see, then this split's share in whole tiles
    last_pos = first_pos + tl.minimum(tile_start + BLOCK_M, q_end) - 1 - q_begin
    lo: tl.int32 = 0
    if window > 0:
        lo = tl.maximum(first_pos + tile_start - q_begin - window + 1, 0)
    hi = last_pos + 1
    tiles_per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS)
    start = lo + split * tiles_per_split * BLOCK_N
    stop = tl.minimum(hi, start + tiles_per_split * BLOCK_N)

    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
    cache_head = kv_head.to(tl.int64) * stride_ch
    scale = scale * LOG2E
    for kv_start in range(start, stop, BLOCK_N):
        pos = kv_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < stop
        block = tl.load(block_table + row * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot = cache_head + block * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        kt = _load_cache(k_cache + slot[:, None] + dims[None, :], kv_mask, FP8)
        vt = _load_cache(v_cache + slot[:, None] + dims[None, :], kv_mask, FP8)
        scores = _dot(qv, tl.trans(kt.to(qv.dtype)), INTERPRETED) * scale
        visible = pos_ok[None, :] & (pos[None, :] <= qpos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        s = s * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(qv.dtype), vt.to(qv.dtype), INTERPRETED)
        m = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        result = acc / tl.where(s > 0, s, 1.0)[:, None]
        tl.store(out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 result.to(out.dtype.element_ty), mask=out_mask)
    else:  # partials [T, Hq, NUM_SPLITS, (D)], contiguous
        part = (token * tl.num_programs(1) * G + head) * NUM_SPLITS + split
        tl.store(part_acc + part[:, None] * D_PAD + dims[None, :], acc, mask=out_mask)
        tl.store(part_max + part, m, mask=row_ok)
        tl.store(part_sum + part, s, mask=row_ok)


@triton.jit
def _dot(a, b, INTERPRETED: tl.constexpr):
    """a @ b accumulated in float32; float32 operands in full precision (not TF32: float32 caches and
    TurboQuant's code-space sums are float32 so that they match the torch reference). Triton 3.9's
    interpreter misreads bf16 dot operands, so there the (exactly representable) operands are
    widened first: the same products, the same sums."""
    if INTERPRETED:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b).to(tl.float32)
    return c


@triton.jit
def _load_cache(ptr, mask, FP8: tl.constexpr):
    if FP8:  # stored as bytes: the interpreter has no fp8 tensors to pass
        x = tl.load(ptr, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    return x  # one return: Triton compiles every return of a function, even one after a taken constexpr branch


@triton.jit
def _merge_splits(out, part_acc, part_max, part_sum, stride_ot, stride_oh, num_heads,
                  D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D_PAD)
    part = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max + part)
    top = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))  # a split that saw no key adds nothing
    total = tl.sum(tl.load(part_sum + part) * weight, 0)
    acc = tl.sum(tl.load(part_acc + part[:, None] * D_PAD + dims[None, :]) * weight[:, None], 0)
    tl.store(out + token * stride_ot + head * stride_oh + dims, (acc / total).to(out.dtype.element_ty),
             mask=dims < D)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, window: int | None,
                    max_query_len: int, num_splits: int = 1) -> torch.Tensor:
    """q [T, Hq, D] of every row (row b's queries are tokens query_start_loc[b]..[b+1], the last
    ones of its seq_lens[b] tokens) over caches [Hk, num_blocks, block_size, D] that already hold
    them; block_table [B, W]. Returns [T, Hq, D] in q's dtype."""
    _check(q, k_cache, v_cache, window, num_splits)
    tokens, num_heads, dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    target = 64 if max_query_len > 1 else MIN_DOT_ROWS
    block_m = max(1, target // group_pad)
    dim_pad = triton.next_power_of_2(dim)
    num_rows = len(seq_lens)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    k_arg, v_arg = (k_cache.view(torch.uint8), v_cache.view(torch.uint8)) if fp8 else (k_cache, v_cache)
    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = q.new_empty((tokens, num_heads, num_splits, dim_pad), dtype=torch.float32)
        part_max = q.new_empty((tokens, num_heads, num_splits), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # not read
    grid = (tokens // block_m + num_rows, kv_heads, num_splits)
    _paged_attention[grid](
        q, k_arg, v_arg, out, part_acc, part_max, part_sum, block_table, seq_lens, query_start_loc,
        num_rows, scale, window or 0, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        G=group, G_PAD=group_pad, D=dim, D_PAD=dim_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=max(16, min(64, triton.next_power_of_2(block_size))), NUM_SPLITS=num_splits, FP8=fp8,
        INTERPRETED=interpreted())
    if num_splits > 1:
        _merge_splits[(tokens, num_heads)](out, part_acc, part_max, part_sum, out.stride(0), out.stride(1),
                                           num_heads, D=dim, D_PAD=dim_pad, NUM_SPLITS=num_splits)
    return out


def interpreted() -> bool:
    """Whether kernels run on Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def choose_splits(num_programs: int, longest_context: int) -> int:
    """Split-KV when the batch has too few programs to fill the GPU and a context is long enough
    that one program's walk would dominate; a power of two up to MAX_SPLITS."""
    if longest_context < SPLIT_MIN_CONTEXT or num_programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    wanted = min(MAX_SPLITS, SPLIT_TARGET_PROGRAMS // max(num_programs, 1), longest_context // 1024)
    return max(1, 1 << (wanted.bit_length() - 1))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None, num_splits: int) -> None:
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"paged attention: query dtype {q.dtype} is not supported; allowed: {QUERY_DTYPES}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged attention: cache dtypes {k_cache.dtype} / {v_cache.dtype} are not supported; "
                         f"allowed: one of {CACHE_DTYPES} for both")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged attention: q and the caches need unit stride along the head dim, "
                         "and K and V the same layout")
    if q.shape[1] % k_cache.shape[0] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged attention: q {tuple(q.shape)} does not fit a cache of shape "
                         f"{tuple(k_cache.shape)} (query heads a multiple of KV heads, same head size)")
    if window is not None and (isinstance(window, bool) or window < 1):
        raise ValueError(f"paged attention: sliding window {window!r} must be a positive integer or None")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"paged attention: num_splits={num_splits} must be a power of two >= 1")
