"""kv_cache_recent_tokens / kv_cache_sink_tokens: the newest R and the first S tokens of each
sequence read in 16 bits, the rest from codes."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.attention import turboquant
from slipstream.kvcache.cache import WHOLE_WINDOW_TOKENS, KVCache
from slipstream.kvcache.dtype import parse_kv_cache_dtype
from slipstream.kvcache.recent_window import staging_blocks
from slipstream.kvcache.turboquant_cache import TurboQuantLayerCache
from tests.conftest import step_metadata
from tests.engine.test_block_accounting import run_shared_prefix_workload

BLOCK, HEADS, KV_HEADS, DIM, RECENT, SCALE = 4, 4, 2, 64, 6, 0.125
TABLES = {"a": [3, 7, 1, 9], "b": [5, 2, 8]}


def _cache(num_staging: int, recent: int = RECENT, sinks: int = 0) -> TurboQuantLayerCache:
    cache = TurboQuantLayerCache(12, BLOCK, KV_HEADS, DIM, 3, "mse", seed=1, device=torch.device("cpu"),
                                 recent_tokens=recent, num_staging=num_staging, dense_dtype=torch.float32,
                                 sink_tokens=sinks)
    g = torch.Generator().manual_seed(5)
    cache.calibrate(torch.randn(32, HEADS, DIM, generator=g), torch.randn(32, KV_HEADS, DIM, generator=g) * 3,
                    torch.randn(32, KV_HEADS, DIM, generator=g))
    return cache


def _step(decodes: list[tuple[str, int]], prefills: list[tuple[str, int, int]]):
    """Metadata for decode tokens (seq, position) then prefill chunks (seq, first position, length)."""
    slot = lambda seq, p: TABLES[seq][p // BLOCK] * BLOCK + p % BLOCK
    slots = [slot(s, p) for s, p in decodes]
    for seq, first, n in prefills:
        slots += [slot(seq, p) for p in range(first, first + n)]
    return step_metadata([1] * len(decodes) + [n for _, _, n in prefills],
                         [p + 1 for _, p in decodes] + [first + n for _, first, n in prefills],
                         [TABLES[s] for s, _ in decodes] + [TABLES[s] for s, _, _ in prefills], slots)


def _expected(q, cache, seq, pos, exact_k, exact_v, own_positions, staged=None):
    """One query at `pos`: 16-bit K/V for its step's own tokens and for staged ones among the recent or sink ones,
    codes for the rest; `staged` [pos + 1] bool, by default the cache's staging."""
    table = torch.tensor(TABLES[seq])
    k, v = cache.gather(table, pos + 1, torch.float32)  # dequantized [Hk, pos+1, D]
    t = torch.arange(pos + 1)
    staged = cache.window.exists(table)[:pos + 1] if staged is None else staged
    near = (t > pos - cache.window.tokens) | (t < cache.window.sinks)
    exact = (near & staged) | torch.isin(t, torch.tensor(own_positions))
    k = torch.where(exact[None, :, None], exact_k[:pos + 1].transpose(0, 1), k)
    v = torch.where(exact[None, :, None], exact_v[:pos + 1].transpose(0, 1), v)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    probs = (torch.einsum("hd,htd->ht", q, k) * SCALE).softmax(-1)
    return torch.einsum("ht,htd->hd", probs, v)


@pytest.mark.parametrize("recent, sinks", [(RECENT, 0), (RECENT, 2), (0, 3), (2, 5)])
@pytest.mark.parametrize("num_staging", [16, 2])  # 2: most blocks find no staging and read codes
def test_attention_reads_recent_and_sink_tokens_in_16_bits_and_the_rest_from_codes(num_staging, recent, sinks):
    g = torch.Generator().manual_seed(0)
    cache = _cache(num_staging, recent, sinks)
    exact = {s: (torch.randn(16, KV_HEADS, DIM, generator=g), torch.randn(16, KV_HEADS, DIM, generator=g))
             for s in TABLES}
    steps = [([], [("a", 0, 10), ("b", 0, 7)]), ([("b", 7)], [("a", 10, 5)]), ([("a", 15), ("b", 8)], [])]
    for decodes, prefills in steps:
        meta = _step(decodes, prefills)
        rows = [(s, p) for s, p in decodes] + [(s, p) for s, first, n in prefills for p in range(first, first + n)]
        k = torch.stack([exact[s][0][p] for s, p in rows])
        v = torch.stack([exact[s][1][p] for s, p in rows])
        q = torch.randn(len(rows), HEADS, DIM, generator=g)
        out = turboquant.paged_attention(q, k, v, cache, meta, SCALE)
        for row, (seq, pos) in enumerate(rows):
            if any(s == seq and first == 0 for s, first, _ in prefills):
                continue  # a first chunk attends to its fresh K/V only, as without the window
            new = [p for s, p in rows if s == seq]
            want = _expected(q[row], cache, seq, pos, *exact[seq], new)
            assert torch.allclose(out[row], want, atol=1e-5), (seq, pos, (out[row] - want).abs().max())
    if num_staging == 16 and recent == RECENT:  # every block in a window got staging
        assert cache.window.exists(torch.tensor(TABLES["a"][2:]))[:16 - 8].all()
    if num_staging == 16 and sinks:
        assert cache.window.exists(torch.tensor([TABLES["a"][0], TABLES["b"][0]])).all()


def test_a_reused_block_drops_its_stale_staging():
    cache = _cache(16)
    k = torch.randn(8, KV_HEADS, DIM)
    meta = _step([], [("a", 0, 8)])  # blocks 3, 7; both in a 6-token window of position 7
    turboquant.paged_attention(torch.randn(8, HEADS, DIM), k, k, cache, meta, SCALE)
    planned = cache.window.staging.host_staging_of
    assert [planned[3], planned[7]] != [-1, -1]  # the plan, which reads see next step
    TABLES["c"] = [3, 11, 4]  # block 3 reused at index 0, out of the window of position 11
    try:
        meta = _step([], [("c", 0, 12)])
        turboquant.paged_attention(torch.randn(12, HEADS, DIM), torch.randn(12, KV_HEADS, DIM),
                                   torch.randn(12, KV_HEADS, DIM), cache, meta, SCALE)
    finally:
        del TABLES["c"]
    assert planned[3] == -1 and planned[11] >= 0 and planned[4] >= 0


def test_chunks_read_their_whole_window_in_16_bits_from_a_pool_sized_for_decode():
    """A chunk's tail takes the slots of the window its first queries read: they still read it in 16 bits."""
    g = torch.Generator().manual_seed(3)
    cache = _cache(staging_blocks(RECENT, 0, BLOCK, 1))  # 3 blocks: a decode step's window
    TABLES["d"] = [3, 7, 1, 9, 10]
    try:
        exact_k, exact_v = torch.randn(17, KV_HEADS, DIM, generator=g), torch.randn(17, KV_HEADS, DIM, generator=g)
        for decodes, prefills in [([], [("d", 0, 8)]), ([], [("d", 8, 8)]), ([("d", 16)], [])]:
            meta = _step(decodes, prefills)
            positions = [p for _, p in decodes] + [p for _, first, n in prefills for p in range(first, first + n)]
            q = torch.randn(len(positions), HEADS, DIM, generator=g)
            out = turboquant.paged_attention(q, exact_k[positions], exact_v[positions], cache, meta, SCALE)
            for row, pos in enumerate(positions):
                if pos >= 8:  # every token of (pos - R, pos] exact
                    every = torch.ones(pos + 1, dtype=torch.bool)  # staged, as far as the window reaches
                    want = _expected(q[row], cache, "d", pos, exact_k, exact_v, positions, every)
                    assert torch.allclose(out[row], want, atol=1e-5), (pos, (out[row] - want).abs().max())
    finally:
        del TABLES["d"]


def test_staging_comes_out_of_the_memory_budget():
    shapes, spec = [(3, 64)] * 30, parse_kv_cache_dtype("tq3", torch.bfloat16)
    plain = KVCache(shapes, spec, torch.bfloat16, 64 * 2**20, 16, torch.device("meta"))
    windowed = KVCache(shapes, spec, torch.bfloat16, 64 * 2**20, 16, torch.device("meta"),
                       recent_tokens=32, max_num_seqs=4, sink_tokens=4)
    staged_bytes = 4 * (3 + 1) * 16 * 30 * 2 * 3 * 64 * 2  # seqs x (recent + sink blocks) x tokens x layers x K,V bf16
    assert windowed.window_memory == staged_bytes
    assert windowed.num_blocks == (64 * 2**20 - staged_bytes) // (16 * plain.bytes_per_token)
    assert windowed.bytes_per_token == plain.bytes_per_token


def test_a_short_sliding_window_is_kept_whole_in_16_bits_and_read_without_codes():
    spec = parse_kv_cache_dtype("tq3", torch.float32)
    kv = KVCache([(KV_HEADS, DIM)] * 3, spec, torch.float32, 2**22, BLOCK, torch.device("cpu"), recent_tokens=2,
                 max_num_seqs=2, sink_tokens=1, sliding_windows=[RECENT, None, WHOLE_WINDOW_TOKENS + 1])
    sliding, full, long_sliding = kv.layers
    assert (sliding.window.tokens, sliding.window.sinks) == (RECENT, 0)  # no sinks: never inside the window
    assert (full.window.tokens, full.window.sinks) == (long_sliding.window.tokens, long_sliding.window.sinks) == (2, 1)
    longer_recent = KVCache([(KV_HEADS, DIM)], spec, torch.float32, 2**22, BLOCK, torch.device("meta"),
                            recent_tokens=4 * RECENT, sink_tokens=0, sliding_windows=[RECENT])
    assert longer_recent.layer_windows == [(RECENT, 0)]  # no more than the layer reads
    # sequences x staging blocks (3 a window, 3 windows) x tokens x K, V in bf16
    assert kv.window_memory == 2 * (3 + 2 * 3) * BLOCK * KV_HEADS * DIM * 2 * 2
    g = torch.Generator().manual_seed(3)
    sliding.calibrate(torch.randn(32, HEADS, DIM, generator=g), torch.randn(32, KV_HEADS, DIM, generator=g) * 3,
                      torch.randn(32, KV_HEADS, DIM, generator=g))
    exact = {s: (torch.randn(16, KV_HEADS, DIM, generator=g), torch.randn(16, KV_HEADS, DIM, generator=g))
             for s in TABLES}
    for decodes, prefills in [([], [("a", 0, 10), ("b", 0, 7)]), ([("b", 7)], [("a", 10, 5)]), ([("a", 15)], [])]:
        rows = [(s, p) for s, p in decodes] + [(s, p) for s, first, n in prefills for p in range(first, first + n)]
        k, v = (torch.stack([exact[s][i][p] for s, p in rows]) for i in (0, 1))
        q = torch.randn(len(rows), HEADS, DIM, generator=g)
        out = turboquant.paged_attention(q, k, v, sliding, _step(decodes, prefills), SCALE, RECENT)
        for row, (seq, pos) in enumerate(rows):
            fresh = any(s == seq and first == 0 for s, first, _ in prefills)  # a first chunk reads its own k/v
            seen = slice(max(0, pos + 1 - RECENT), pos + 1)
            keys, values = ((x if fresh else x.bfloat16().float())[seen].repeat_interleave(HEADS // KV_HEADS, 1)
                            for x in exact[seq])
            probs = (torch.einsum("hd,thd->ht", q[row], keys) * SCALE).softmax(-1)
            want = torch.einsum("ht,thd->hd", probs, values)
            assert torch.allclose(out[row], want, atol=1e-5), (seq, pos, (out[row] - want).abs().max())


def _tiny_tq3(tiny_llama, blocks: int, **knobs) -> LLM:
    """tq3 on the tiny model with room for `blocks` blocks after the 16-bit staging."""
    spec = parse_kv_cache_dtype("tq3", torch.float32)
    staging = KVCache([(2, 16)] * 2, spec, torch.float32, 10**9, 16, torch.device("meta"), recent_tokens=knobs[
        "kv_cache_recent_tokens"], max_num_seqs=4, sink_tokens=knobs["kv_cache_sink_tokens"]).window_memory
    block_bytes = 16 * KVCache.bytes_per_token_of([(2, 16)] * 2, spec)
    return LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq3", max_num_seqs=4,
               kv_cache_memory=blocks * block_bytes + staging, **knobs)


@pytest.mark.parametrize("recent, sinks", [(8, 0), (8, 3), (0, 20)])
def test_prefix_caching_and_preemption_invariants_with_16_bit_tokens(tiny_llama, recent, sinks):
    llm = _tiny_tq3(tiny_llama, 8, kv_cache_recent_tokens=recent, kv_cache_sink_tokens=sinks)
    run_shared_prefix_workload(llm.engine)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0 and stats["num_used_blocks"] == 0


def test_a_prefix_hit_computes_its_sinks_again_once_their_staging_is_gone(tiny_llama):
    """One sequence's staging (3 blocks): a 200-token prompt that decodes into a new block between the two runs of
    a prompt takes all three, the cached prompt's sink block's too, which is never staged again; the hit then
    computes its sink block again into a fresh block and shares the two after it, rather than read its sinks from
    codes, and reads as a hit without the other prompt does."""
    knobs = dict(dtype="float32", kv_cache_dtype="tq3", max_num_seqs=1, kv_cache_recent_tokens=8,
                 kv_cache_sink_tokens=3)
    prompt, greedy = list(range(3, 60)), SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    cold = LLM(tiny_llama, **knobs).generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    hits = {}
    for contended in (False, True):
        llm = LLM(tiny_llama, **knobs)
        llm.generate([prompt], greedy, use_tqdm=False)
        if contended:
            llm.generate([list(range(100, 300))], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
        hits[contended] = llm.generate([prompt], greedy, use_tqdm=False)[0]
        assert hits[contended].outputs[0].token_ids == cold.token_ids
        assert llm.stats()["num_used_blocks"] == 0
    assert [hits[c].num_cached_tokens for c in (False, True)] == [48, 32]
    got, want = ([next(iter(step.values())).logprob for step in hits[c].outputs[0].logprobs] for c in (True, False))
    assert got == pytest.approx(want, abs=1e-4)  # equal here; the head's 16-row GEMMs may round apart elsewhere


@pytest.mark.parametrize("knob", ["kv_cache_recent_tokens", "kv_cache_sink_tokens"])
def test_knobs_must_be_non_negative_integers(tiny_llama, knob):
    with pytest.raises(ValueError, match=f"{knob}=-1"):
        LLM(tiny_llama, **{knob: -1})
