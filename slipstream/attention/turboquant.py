"""Attention that reads TurboQuant codes directly, for mixed prefill/decode batches.

Queries are scaled by the cache's fixed per-channel key scale and rotated once per step;
key scores come from the codes (centroid gather in the rotated space, plus the QJL term for
`-qjl` keys); values are accumulated in the rotated space and rotated back once per query
row. The cache is never dequantized to the original space. A backend may pass kernels for
the decode queries and for prefill chunks over a cached prefix (the CPU's read each
sequence's own blocks' packed codes, no gather or padding: backends/cpu/attention.py);
otherwise the same math runs in torch (`TurboQuantizer.scores`, the cache's `value_sum`), which
kernels are tested against. A prefill chunk with no cached prefix attends to its own fresh
K/V (as every engine does); every other query reads the codes, but for the 16-bit window's tokens (below).
Long chunks may instead take `expanded_prefill`: the context's codes expanded once into code
space, then one fused SDPA, which turns the per-query reading of codes into GEMMs.

With R recent and S sink tokens (kvcache/recent_window.py), a query at position p reads in 16 bits
instead every token of its own step (from the fresh k/v, causal) and every older token t with t > p - R
or t < S from the cache's staging blocks where it has one (else from the codes). Each token is scored
exactly once; code and 16-bit logits share one softmax (the codes hold k - mu, so <q, mu> is
taken off the 16-bit logits). A kernel applies the same rule token by token, reading staged
tokens from the staging blocks and the query's own from the fresh k/v.
"""
from __future__ import annotations

import math

import torch

from slipstream.attention import reference
from slipstream.attention.metadata import AttentionMetadata, PrefillChunk
from slipstream.kvcache.recent_window import RecentWindow, Staging
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                    decode_kernel=None, prefill_kernel=None, dense_prefill=reference.prefill_attention,
                    decode_step=None) -> torch.Tensor:
    """As reference.paged_attention, on the codes; `decode_kernel(q [B, Hk, G, D], k, v, cache,
    tables, lens, scale, window)` is a backend's kernel for the decode queries and
    `prefill_kernel(q [n, Hk, G, D], k, v, cache, chunk, scale, window)` for a chunk over a
    cached prefix; `decode_step(q, k, v, cache, meta, scale, window)` writes and attends a step of decodes
    alone at once (each returns None: declined); `dense_prefill` attends a first chunk to its own K/V
    (reference.prefill_attention's arguments)."""
    if not cache.calibrated:
        return _calibration_attention(q, k, v, cache, scale, sliding_window)
    if cache.window is not None:
        place_staging(cache.window.staging, meta)
    if decode_step is not None and not meta.prefills:
        out = decode_step(q, k, v, cache, meta, scale, sliding_window)
        if out is not None:
            return out
    cache.write(k, v, meta.slot_mapping)  # the codes, and the 16-bit window's tokens that the plan mirrors now
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        out[:n] = _decode(q[:n], k[:n], v[:n], cache, meta, scale, sliding_window, decode_kernel)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        if chunk.context_len == chunk.length:
            fresh_k, fresh_v = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            out[rows] = dense_prefill(q[rows], fresh_k, fresh_v, chunk, scale, sliding_window)
        else:
            out[rows] = _prefill(q[rows], k[rows], v[rows], cache, chunk, scale, sliding_window, prefill_kernel)
    if cache.window is not None:  # after the reads: a chunk's tail may take the slots of the window they read
        cache.window.write(k, v, late=True)
    return out


def _calibration_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                           scale: float, sliding_window: int | None) -> torch.Tensor:
    """The calibration prompt (one sequence, prefill only) attends exactly to everything it has seen."""
    keys, values = cache.observe(q, k, v)
    chunk = PrefillChunk(0, len(q), keys.shape[1], block_table=None)
    return reference.prefill_attention(q, keys.to(q.dtype), values.to(q.dtype), chunk, scale, sliding_window)


def place_staging(staging: Staging, meta: AttentionMetadata) -> None:
    """Once per step for the layers that share `staging`: staging for the blocks this step's new tokens start in
    their sequence's window, none for those they start outside it; every window's blocks kept."""
    key = ("staging placed", id(staging))
    if key in meta.step_cache:
        return
    active, in_window = [], []
    for row, end in enumerate(meta.context_lens):
        length, table = meta.query_start[row + 1] - meta.query_start[row], meta.block_table_cpu[row]
        first, sinks = staging.first_block(end), staging.sink_blocks
        active += table[:min(sinks, first)].tolist() + table[first:math.ceil(end / staging.block_size)].tolist()
        in_window += [not sinks <= p // staging.block_size < first for p in range(end - length, end)]
    staging.assign(meta.slot_mapping_cpu, in_window, active, defer=bool(meta.prefills))
    meta.step_cache[key] = True


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
            meta: AttentionMetadata, scale: float, window: int | None, decode_kernel=None) -> torch.Tensor:
    n, tables, lens = q.shape[0], meta.decode_block_tables, meta.decode_context_lens
    qg = q.view(n, cache.k.shape[2], -1, q.shape[-1])  # [B, Hk, G, D]
    out = None if decode_kernel is None else decode_kernel(qg, k, v, cache, tables, lens, scale, window)
    if out is None:
        tables = meta.narrow_decode_tables(cache.block_size)
        keys, values = cache.codes_by_head(tables)  # [B, Hk, L, nbytes]
        visible = reference.decode_mask(keys.shape[2], lens, window)  # [B, L]
        dense = None
        if cache.window is not None:
            visible = visible & ~_read_dense(cache.window, tables, lens)
            dense = _decode_dense(cache.window, k, v, tables, lens, window)
        out = _attend(qg, keys, values, visible[:, None, None, :], cache, scale, dense)
    return out.reshape(n, *q.shape[1:])


def _decode_dense(recent: RecentWindow, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                  lens: torch.Tensor, window: int | None):
    """The 16-bit K/V [B, Hk, Ls+1, D] of each query's window (staged, then its own token) and their mask."""
    qpos = (lens - 1)[:, None]  # [B, 1]
    staged_k, staged_v, staged_pos, exists = _staged_decode_window(recent, tables, lens)  # [B, Ls, ...]
    staged_mask = exists & (staged_pos < qpos) & _near(staged_pos, qpos, recent, window)
    dense_k = torch.cat([staged_k, k[:, None].to(staged_k.dtype)], 1).transpose(1, 2)
    dense_v = torch.cat([staged_v, v[:, None].to(staged_v.dtype)], 1).transpose(1, 2)
    dense_mask = torch.cat([staged_mask, torch.ones_like(staged_mask[:, :1])], 1)
    return dense_k, dense_v, dense_mask[:, None, None, :]


def _read_dense(recent: RecentWindow, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[B, L] bool: code slots that each decode query reads in 16 bits instead (its own, or staged and near)."""
    qpos = (lens - 1)[:, None]
    pos = torch.arange(tables.shape[1] * recent.block_size, device=lens.device)
    return (recent.exists(tables) & _near(pos, qpos, recent, None)) | (pos == qpos)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
             chunk: PrefillChunk, scale: float, window: int | None, kernel=None) -> torch.Tensor:
    n, num_heads, dim = q.shape
    num_kv = cache.k.shape[2]
    group = num_heads // num_kv
    out = None if kernel is None else kernel(q.view(n, num_kv, group, dim), k, v, cache, chunk, scale, window)
    if out is not None:
        return out.view(n, num_heads, dim).to(q.dtype)
    keys, values = cache.codes_by_head(chunk.block_table)
    keys, values = keys[:, :chunk.context_len], values[:, :chunk.context_len]  # [Hk, L, nb]
    qg = q.view(n, num_kv, group, dim).permute(1, 2, 0, 3).reshape(num_kv, -1, dim)  # [Hk, G*n, D]
    mask, dense = _prefill_reads(k, v, cache, chunk, window)
    if dense is not None:
        dense = (*dense[:2], dense[2].repeat(group, 1))
    out = _attend(qg, keys, values, mask.repeat(group, 1), cache, scale, dense)  # [Hk, G*n, D]
    return out.view(num_kv, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim).to(q.dtype)


def expanded_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache,
                     chunk: PrefillChunk, scale: float, window: int | None, expand,
                     dense_prefill=reference.prefill_attention) -> torch.Tensor:
    """What `_prefill` computes for a chunk's queries q [n, Hk, G, D], as one fused
    scaled_dot_product_attention in code space, for chunks long enough that its GEMMs win over
    reading codes per query: `expand(cache, chunk, length, dtype)` gives the first `length` context tokens'
    code-space key and value rows [Hk, length, W] (TurboQuantLayerCache.code_space or a backend's twin), only
    as far as some query reads codes, the queries enter
    key code space through `decode_maps`, and the 16-bit tokens join the same softmax, mapped into code
    space by `embed_maps`. A chunk that reads no code attends to its 16-bit tokens through `dense_prefill`
    (reference.prefill_attention's arguments). Returns [n, Hk, G, D] in q's dtype."""
    n, num_kv, group, dim = q.shape
    to_keys, back = cache.decode_maps
    mask, dense = _prefill_reads(k, v, cache, chunk, window)
    key = ("blocks", id(mask), q.dtype)  # the memo keeps mask alive, so its id stays its own
    if key not in chunk.memo:
        chunk.memo[key] = _query_blocks(mask, None if dense is None else dense[2], q.dtype, window)
    (lo, hi), blocks = chunk.memo[key]
    if lo == hi:
        return _window_prefill(q, dense, chunk, scale, window, dense_prefill)
    code_k, code_v = (x[:, lo:] for x in expand(cache, chunk, hi, q.dtype))
    if dense is not None:
        embed_k, embed_v = cache.embed_maps
        dense_k, dense_v, _ = dense
        code_k = torch.cat([code_k, ((dense_k.float() - cache.key_mean[:, None]) @ embed_k).to(q.dtype)], 1)
        code_v = torch.cat([code_v, (dense_v.float() @ embed_v).to(q.dtype)], 1)
    qk = (q.float().permute(1, 2, 0, 3) @ to_keys[:, None]).flatten(0, 1)  # [Hk * G, n, Wk]
    out = reference.blocked_attention(qk[None].to(q.dtype), code_k[None], code_v[None], blocks, scale)
    out = out[0].float().view(num_kv, group * n, -1) @ back  # [Hk, G*n, D]
    return out.view(num_kv, group, n, dim).permute(2, 0, 1, 3).to(q.dtype)


def _window_prefill(q: torch.Tensor, dense: tuple, chunk: PrefillChunk, scale: float, window: int | None,
                   dense_prefill) -> torch.Tensor:
    """expanded_prefill's attention where no row reads a code (a sliding layer that stages its window): what the
    rows see is then one run of positions, all 16-bit, ending with their own, attended as a dense cache's chunk
    without the code-space maps (Gemma 3's sliding layers spent 0.8 s of an 8k prompt on them). The staged part
    of the run is the staged columns that some row sees; the key mean the code space takes off is one constant
    per row there, which softmax ignores."""
    n, num_kv, group, dim = q.shape
    dense_k, dense_v, dense_mask = dense  # [Hk, Ls + n, D], [n, Ls + n]
    staged = dense_k.shape[1] - n
    seen = dense_mask[:, :staged].any(0).nonzero().flatten()
    run = slice(int(seen[0]), int(seen[0]) + len(seen)) if len(seen) else slice(0, 0)
    k_run, v_run = (torch.cat([x[:, run], x[:, staged:]], 1).to(q.dtype) for x in (dense_k, dense_v))
    out = dense_prefill(q.reshape(n, num_kv * group, dim), k_run, v_run, chunk, scale, window)
    return out.view(n, num_kv, group, dim)


def _query_blocks(mask: torch.Tensor, dense_mask: torch.Tensor | None, dtype: torch.dtype,
                  window: int | None) -> tuple[tuple[int, int], list]:
    """The code columns [lo, hi) that some query reads, and `reference.query_blocks` of those and the 16-bit
    columns (split in a sliding layer). A sliding layer that stages its whole window reads no codes:
    Gemma 3's chunks had attended over every code column of the context, all of them masked (tq3, one 8k prompt:
    6.14 -> 4.06 s)."""
    read = mask.any(0).nonzero().flatten().tolist()
    lo, hi = (read[0], read[-1] + 1) if read else (0, 0)
    visible = mask[:, lo:hi] if dense_mask is None else torch.cat([mask[:, lo:hi], dense_mask], 1)
    return (lo, hi), reference.query_blocks(visible, dtype, split=window is not None)


def _prefill_reads(k: torch.Tensor, v: torch.Tensor, cache: TurboQuantLayerCache, chunk: PrefillChunk,
                   window: int | None):
    """Which context tokens each of a chunk's queries reads from its codes, mask [n, L], and, with a 16-bit
    window, the tokens it reads in 16 bits: (K, V [Hk, Ls + n, D] staged then its own, mask [n, Ls + n]).
    The masks depend on positions and on which blocks are staged, which the layers sharing a `Staging` agree
    on once it is placed for the step: computed once per step for all of them."""
    recent = cache.window
    if recent is None:
        key = ("causal", window)
        if key not in chunk.memo:
            device = chunk.block_table.device
            chunk.memo[key] = reference.causal_mask(chunk.length, chunk.context_len, window, device)
        return chunk.memo[key], None
    key = ("reads", window, id(recent.staging))  # the memo lives one step, as long as the staging it names
    if key not in chunk.memo:
        chunk.memo[key] = _read_masks(recent, chunk, window)
    mask, dense_mask, index = chunk.memo[key]
    staged_k, staged_v = recent.gather(chunk.block_table[index])  # [Ls, Hk, D]
    dense_k = torch.cat([staged_k, k.to(staged_k.dtype)]).transpose(0, 1)  # [Hk, Ls+n, D]
    dense_v = torch.cat([staged_v, v.to(staged_v.dtype)]).transpose(0, 1)
    return mask, (dense_k, dense_v, dense_mask)


def _read_masks(recent: RecentWindow, chunk: PrefillChunk,
                window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The code mask [n, L], the 16-bit mask [n, Ls + n], and the staged prefix blocks' indices in the table.
    The chunk's own tokens are all read in 16 bits: had its queries read the older of them from their codes, each
    own token would have been a column of both kinds (SmolLM2, 8k prompt: n + ~160 more columns per chunk)."""
    staged = recent.staging_of[chunk.block_table] >= 0  # [blocks]
    index = _staged_prefill_blocks(recent, chunk)
    n, length, device = chunk.length, chunk.context_len, staged.device
    start = length - n
    pos = torch.arange(length, device=device)
    qpos = pos[start:, None]  # [n, 1]
    exact = staged.repeat_interleave(recent.block_size)[:length] & _near(pos, qpos, recent, None)
    mask = reference.causal_mask(n, length, window, device) & ~exact & (pos < start)
    staged_pos = _positions(index, recent.block_size)
    exists = staged[index].repeat_interleave(recent.block_size) & (staged_pos < start)
    staged_mask = exists & _near(staged_pos, qpos, recent, window)
    return mask, torch.cat([staged_mask, reference.causal_mask(n, n, window, device)], 1), index


def _staged_decode_window(window: RecentWindow, tables: torch.Tensor, lens: torch.Tensor):
    """Staged K/V [B, W*bs, Hk, D], positions and existence [B, W*bs] of the blocks each window reaches."""
    width = math.ceil(window.tokens / window.block_size) + 1 if window.tokens else 0
    first = ((lens - window.tokens).clamp_min(0) // window.block_size)[:, None]
    sinks = torch.arange(window.sink_blocks, device=lens.device)
    in_recent = (sinks >= first) & (sinks < first + width)
    sinks = torch.where(in_recent, tables.shape[1], sinks)  # already in the recent part: moved past the table
    index = torch.cat([sinks, first + torch.arange(width, device=lens.device)], 1)  # past the table: masked by position
    blocks = tables.gather(1, index.clamp_max(tables.shape[1] - 1))
    return (*window.gather(blocks), _positions(index, window.block_size), window.exists(blocks))


def _staged_prefill_blocks(window: RecentWindow, chunk: PrefillChunk) -> torch.Tensor:
    """Indices into the chunk's block table of the cached-prefix blocks its window reaches (sinks, then recent)."""
    prefix = chunk.context_len - chunk.length
    first = max(0, prefix + 1 - window.tokens) // window.block_size
    device = chunk.block_table.device
    return torch.cat([torch.arange(min(window.sink_blocks, first), device=device),
                      torch.arange(first, math.ceil(prefix / window.block_size), device=device)])


def _positions(block_index: torch.Tensor, block_size: int) -> torch.Tensor:
    offsets = torch.arange(block_size, device=block_index.device)
    return (block_index[..., None] * block_size + offsets).flatten(-2)


def _near(tpos: torch.Tensor, qpos: torch.Tensor, window: RecentWindow, sliding: int | None) -> torch.Tensor:
    """t in (p - R, p] or one of the first sink tokens (t <= p), and inside the sliding window if any."""
    near = ((tpos > qpos - window.tokens) | (tpos < window.sinks)) & (tpos <= qpos)
    return near & (tpos > qpos - sliding) if sliding is not None else near


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
            cache: TurboQuantLayerCache, scale: float, dense=None) -> torch.Tensor:
    """q [..., Hk, M, D]; codes [..., Hk, L, nbytes]; dense (k, v [..., Hk, Ld, D], mask) or None."""
    q = q.float()
    scores = cache.key_quantizer.scores(q * cache.key_scale[:, None, :], keys) * scale  # <q*sigma, (k-mu)/sigma>
    scores = scores.masked_fill(~visible, float("-inf"))
    if dense is None:
        return cache.value_sum(scores.softmax(-1), values)
    dense_k, dense_v, dense_mask = dense
    dense_scores = (q @ (dense_k.float() - cache.key_mean[:, None, :]).transpose(-1, -2)) * scale
    probs = torch.cat([scores, dense_scores.masked_fill(~dense_mask, float("-inf"))], -1).softmax(-1)
    length = scores.shape[-1]
    return (cache.value_sum(probs[..., :length], values)
            + probs[..., length:] @ dense_v.float())
