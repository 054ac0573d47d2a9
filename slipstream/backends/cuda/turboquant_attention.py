"""TurboQuant attention in Triton: decode rows and prefill chunks over a cached prefix, reading the
packed codes, with the 16-bit recent/sink window in the same softmax.

Owns: the kernel and the per-coordinate tables it decodes rows with. Must never know blocks'
owners, the scheduler or models, nor how codes are made (kvcache/turboquant.py owns the byte
layout; this module reads it only through `TurboQuantizer.row_layout`).

The math is attention/turboquant.py's (the reference it is tested against): queries arrive
already mapped to key code space (q @ decode_maps[0], sigma and the rotation folded in), a
key's code-space vector z is decoded tile by tile from its bytes and scored as <q_rot, z>;
values are accumulated in value code space and mapped back to channels once per query row,
after the kernel. A token that the rule of attention/turboquant.py reads in 16 bits (near the
query and staged, or one of the step's own tokens) is scored as <q, k - mu> from the staging
blocks or the step's fresh K/V instead, and its value is accumulated in channels; both kinds
share one online softmax. Long contexts over few rows split the KV range as paged_attention.py
does (split-KV), both accumulators merged by its reduction.

Decoding a coordinate j of code space: its code starts at bit `shift[j]` of byte `byte[j]` of
the row (two bytes are read where a 3-bit code straddles them), its value is
`values[base[j] + code]` (the piece's factor folded in), times the norm at `norm[j]` (fp16, or one
byte where `norm_bytes[j]` is 1: NORM8) and, for QJL signs, the fp16 gamma at `gamma[j]`.

This module imports triton at import time: import it lazily.
"""
from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from slipstream.backends.cuda.paged_attention import LOG2E, MIN_DOT_ROWS, _dot, _find_row, _merge_splits, interpreted
from slipstream.kvcache.turboquant import NORM8_BIAS, TurboQuantizer

CODE_VALUES = 16  # entries per piece in row_layout's value table
_NORM8_BIAS = tl.constexpr(NORM8_BIAS)


@triton.jit
def _fp16_at(rows, offset, mask):
    lo = tl.load(rows + offset, mask=mask, other=0).to(tl.int32)
    hi = tl.load(rows + offset + 1, mask=mask, other=0).to(tl.int32)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _norm_at(rows, offset, one_byte, mask):
    """A row's norm at `offset`: fp16, or NORM8 (byte 0 is 0) where one_byte."""
    byte = tl.load(rows + offset, mask=mask & one_byte, other=0).to(tl.int32)
    norm8 = tl.where(byte > 0, ((byte << 19) + _NORM8_BIAS).to(tl.float32, bitcast=True), 0.0)
    return tl.where(one_byte, norm8, _fp16_at(rows, offset, mask & ~one_byte))


@triton.jit
def _decode_rows(rows, ok, table, values, W_PAD: tl.constexpr):
    """Code-space vectors [N, W_PAD] of the rows at byte addresses `rows` [N] (ok: which exist)."""
    j = tl.arange(0, W_PAD)
    byte = tl.load(table + j)
    shift = tl.load(table + W_PAD + j)
    bits = tl.load(table + 2 * W_PAD + j)
    base = tl.load(table + 3 * W_PAD + j)
    norm_at = tl.load(table + 4 * W_PAD + j)
    gamma_at = tl.load(table + 5 * W_PAD + j)
    one_byte = tl.load(table + 6 * W_PAD + j) == 1
    used = bits > 0
    mask = ok[:, None] & used[None, :]
    word = tl.load(rows[:, None] + byte[None, :], mask=mask, other=0).to(tl.int32)
    straddles = mask & (shift + bits > 8)[None, :]
    word = word | (tl.load(rows[:, None] + byte[None, :] + 1, mask=straddles, other=0).to(tl.int32) << 8)
    code = (word >> shift[None, :]) & ((1 << bits[None, :]) - 1)
    z = tl.load(values + base[None, :] + code, mask=mask, other=0.0)
    z = z * _norm_at(rows[:, None], norm_at[None, :], one_byte[None, :], mask)
    has_gamma = mask & (gamma_at >= 0)[None, :]
    gamma = _fp16_at(rows[:, None], gamma_at[None, :], has_gamma)
    return tl.where(has_gamma, z * gamma, z)


@triton.jit
def _turboquant_attention(q, q_rot, key_rows, value_rows, key_table, key_values, value_table, value_values,
                          key_mean, staging_of, staged_k, staged_v, fresh_k, fresh_v, out_code, out_dense,
                          part_code, part_dense, part_max, part_sum,
                          block_table, seq_lens, query_start_loc, num_rows, scale, window,
                          recent, sinks, stride_bt,
                          HK: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                          D_PAD: tl.constexpr, WK: tl.constexpr, WV: tl.constexpr, KEY_BYTES: tl.constexpr,
                          VALUE_BYTES: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = _find_row(query_start_loc, pid, num_rows, BLOCK_M)
    q_begin = tl.load(query_start_loc + row).to(tl.int32)
    q_end = tl.load(query_start_loc + row + 1).to(tl.int32)
    tile_start = q_begin + (pid - (q_begin // BLOCK_M + row)) * BLOCK_M
    context_len = tl.load(seq_lens + row).to(tl.int32)
    step_start = context_len - (q_end - q_begin)  # position of the row's first new token
    if tile_start >= q_end:
        return

    rows = tl.arange(0, BLOCK_M * G_PAD)
    token = tile_start + rows // G_PAD
    head = kv_head * G + rows % G_PAD
    row_ok = (token < q_end) & (rows % G_PAD < G)
    qpos = step_start + token - q_begin
    qk = tl.load(q_rot + (token * HK * G + head)[:, None] * WK + tl.arange(0, WK)[None, :],
                 mask=row_ok[:, None], other=0.0)
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < D
    if HAS_WINDOW:
        qd = tl.load(q + (token * HK * G + head)[:, None] * D + dims[None, :],
                     mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        mean = tl.load(key_mean + kv_head * D + dims, mask=dim_ok, other=0.0)

    last_pos = step_start + tl.minimum(tile_start + BLOCK_M, q_end) - 1 - q_begin
    lo: tl.int32 = 0
    if window > 0:
        lo = tl.maximum(step_start + tile_start - q_begin - window + 1, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(last_pos + 1 - lo, BLOCK_N), NUM_SPLITS)
    start = lo + split * tiles_per_split * BLOCK_N
    stop = tl.minimum(last_pos + 1, start + tiles_per_split * BLOCK_N)
    scale = scale * LOG2E
    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, WV], tl.float32)
    acc_dense = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
    for kv_start in range(start, stop, BLOCK_N):
        pos = kv_start + tl.arange(0, BLOCK_N)
        pos_ok = pos < stop
        block = tl.load(block_table + row * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        slot = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * HK + kv_head
        keys = _decode_rows(key_rows + slot * KEY_BYTES, pos_ok, key_table, key_values, WK)
        scores = _dot(qk, tl.trans(keys), INTERPRETED) * scale
        visible = pos_ok[None, :] & (pos[None, :] <= qpos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        dense = tl.zeros([BLOCK_M * G_PAD, BLOCK_N], tl.int1)
        if HAS_WINDOW:
            # the 16-bit copy: the step's own tokens from the fresh K/V, older ones from staging blocks
            staging = tl.load(staging_of + block, mask=pos_ok, other=-1)
            fresh = pos_ok & (pos >= step_start)
            staged = pos_ok & (staging >= 0) & ~fresh
            near = (pos[None, :] > qpos[:, None] - recent) | (pos[None, :] < sinks)
            dense = visible & ((near & staged[None, :]) | fresh[None, :])
            at_fresh = (q_begin + pos - step_start) * HK + kv_head
            at_staged = (staging * BLOCK_SIZE + pos % BLOCK_SIZE) * HK + kv_head
            load_fresh = fresh[:, None] & dim_ok[None, :]
            load_staged = staged[:, None] & dim_ok[None, :]
            kd = (tl.load(fresh_k + at_fresh[:, None] * D + dims[None, :], mask=load_fresh, other=0.0).to(tl.float32)
                  + tl.load(staged_k + at_staged[:, None] * D + dims[None, :], mask=load_staged, other=0.0)
                  .to(tl.float32))
            vd = (tl.load(fresh_v + at_fresh[:, None] * D + dims[None, :], mask=load_fresh, other=0.0).to(tl.float32)
                  + tl.load(staged_v + at_staged[:, None] * D + dims[None, :], mask=load_staged, other=0.0)
                  .to(tl.float32))
            dense_scores = _dot(qd, tl.trans(kd - mean[None, :]), INTERPRETED) * scale
            scores = tl.where(dense, dense_scores, scores)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        s = s * alpha + tl.sum(p, 1)
        vals = _decode_rows(value_rows + slot * VALUE_BYTES, pos_ok, value_table, value_values, WV)
        acc = acc * alpha[:, None] + _dot(tl.where(dense, 0.0, p), vals, INTERPRETED)
        if HAS_WINDOW:
            acc_dense = acc_dense * alpha[:, None] + _dot(tl.where(dense, p, 0.0), vd, INTERPRETED)
        m = m_new

    where = token * HK * G + head
    if NUM_SPLITS == 1:
        norm = tl.where(s > 0, s, 1.0)[:, None]
        tl.store(out_code + where[:, None] * WV + tl.arange(0, WV)[None, :], acc / norm, mask=row_ok[:, None])
        if HAS_WINDOW:
            tl.store(out_dense + where[:, None] * D + dims[None, :], acc_dense / norm,
                     mask=row_ok[:, None] & dim_ok[None, :])
    else:  # unnormalised partials [T, Hq, NUM_SPLITS, (width)], merged by paged_attention._merge_splits
        part = where * NUM_SPLITS + split
        tl.store(part_code + part[:, None] * WV + tl.arange(0, WV)[None, :], acc, mask=row_ok[:, None])
        if HAS_WINDOW:
            tl.store(part_dense + part[:, None] * D_PAD + dims[None, :], acc_dense, mask=row_ok[:, None])
        tl.store(part_max + part, m, mask=row_ok)
        tl.store(part_sum + part, s, mask=row_ok)


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def coordinate_tables(quantizer: TurboQuantizer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [7, W_PAD] (byte, shift, bits, value base, norm offset, gamma offset, norm bytes per
    code-space coordinate; bits 0 past the code width) and float32 values [pieces * 16], factors folded in."""
    per_device = _TABLES.setdefault(quantizer, {})  # built once per quantizer and device
    if device not in per_device:
        per_device[device] = _build_tables(quantizer, device)
    return per_device[device]


def _build_tables(quantizer: TurboQuantizer, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    pieces, floats = quantizer.row_layout
    width = triton.next_power_of_2(quantizer.code_width)
    table = torch.zeros(7, width, dtype=torch.int32)
    table[5] = -1
    j = 0
    for p, (offset, bits, count, norm_at, gamma_at, norm_bytes) in enumerate(pieces.tolist()):
        bit = torch.arange(count) * bits
        columns = slice(j, j + count)
        table[0, columns] = offset + bit // 8
        table[1, columns] = bit % 8
        table[2, columns] = bits
        table[3, columns] = p * CODE_VALUES
        table[4, columns] = norm_at
        table[5, columns] = gamma_at
        table[6, columns] = norm_bytes
        j += count
    values = floats[:, :1] * floats[:, 1:]  # factor * value
    return table.to(device), values.flatten().contiguous().to(device)


def turboquant_attention(q: torch.Tensor, q_rot: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         scale: float, window: int | None, max_query_len: int,
                         num_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q [T, Hq, D] (float32) over a TurboQuantLayerCache that already holds the step.

    q_rot [T, Hq, W]: q in key code space. Every row reads the codes (a fresh prompt attends to its
    own K/V in torch, as the reference does). Returns (value code-space sums [T, Hq, W_PAD] and, with
    a 16-bit window, the channel sums of its tokens [T, Hq, D]), both already normalised."""
    tokens, num_heads, dim = q.shape
    kv_heads = cache.k.shape[2]
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, (64 if max_query_len > 1 else MIN_DOT_ROWS) // group_pad)
    key_table, key_values = coordinate_tables(cache.key_quantizer, q.device)
    value_table, value_values = coordinate_tables(cache.value_quantizer, q.device)
    wk, wv = key_table.shape[1], value_table.shape[1]
    q_rot = torch.nn.functional.pad(q_rot.float(), (0, wk - q_rot.shape[-1])).contiguous()
    out_code = q.new_empty((tokens, num_heads, wv), dtype=torch.float32)
    recent = cache.window
    if recent is None:
        out_dense = staged = fresh_k = fresh_v = out_code  # not read
        staging_of, recent_tokens, sinks = key_table, 0, 0
        staged_k = staged_v = staged
    else:
        out_dense = q.new_empty((tokens, num_heads, dim), dtype=torch.float32)
        staging_of, staged_k, staged_v = recent.staging_of, recent.k, recent.v
        fresh_k, fresh_v = (x.to(recent.k.dtype).contiguous() for x in (k_new, v_new))
        recent_tokens, sinks = recent.tokens, recent.sinks
    dim_pad = triton.next_power_of_2(dim)
    if num_splits > 1:
        part_code = q.new_empty((tokens, num_heads, num_splits, wv), dtype=torch.float32)
        part_dense = q.new_empty((tokens, num_heads, num_splits, dim_pad), dtype=torch.float32)
        part_max = q.new_empty((tokens, num_heads, num_splits), dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_code = part_dense = part_max = part_sum = out_code  # not read
    grid = (tokens // block_m + len(seq_lens), kv_heads, num_splits)
    _turboquant_attention[grid](
        q.float().contiguous(), q_rot, cache.k, cache.v, key_table, key_values, value_table, value_values,
        cache.key_mean.float().contiguous(), staging_of, staged_k, staged_v, fresh_k, fresh_v, out_code, out_dense,
        part_code, part_dense, part_max, part_sum, block_table, seq_lens, query_start_loc, len(seq_lens), scale, window or 0,
        recent_tokens, sinks, block_table.stride(0),
        HK=kv_heads, G=group, G_PAD=group_pad, D=dim, D_PAD=dim_pad, WK=wk, WV=wv,
        KEY_BYTES=cache.key_quantizer.nbytes, VALUE_BYTES=cache.value_quantizer.nbytes,
        BLOCK_SIZE=cache.block_size, BLOCK_M=block_m, BLOCK_N=16, HAS_WINDOW=recent is not None,
        NUM_SPLITS=num_splits, INTERPRETED=interpreted())
    if num_splits > 1:
        merge = (tokens, num_heads)
        _merge_splits[merge](out_code, part_code, part_max, part_sum, out_code.stride(0), out_code.stride(1),
                             num_heads, D=wv, D_PAD=wv, NUM_SPLITS=num_splits)
        if recent is not None:
            _merge_splits[merge](out_dense, part_dense, part_max, part_sum, out_dense.stride(0), out_dense.stride(1),
                                 num_heads, D=dim, D_PAD=dim_pad, NUM_SPLITS=num_splits)
    return out_code, (None if recent is None else out_dense)
