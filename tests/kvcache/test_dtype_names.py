"""What a kv_cache_dtype name means: bit widths of keys and values, key mode, and its 16-bit window."""
from __future__ import annotations

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.config import EngineConfig
from slipstream.kvcache.cache import DEFAULT_STAGING_SHARE, KVCache
from slipstream.kvcache.dtype import DEFAULT_RECENT_TOKENS, PRESETS, RECENT_TOKENS, SINK_TOKENS, parse_kv_cache_dtype
from tests.conftest import random_prompts

SMOLLM2_SHAPES = [(3, 64)] * 30


@pytest.mark.parametrize("name,key_bits,value_bits,key_mode,window", [
    ("tq-k4v2", 4, 2, "mse", (DEFAULT_RECENT_TOKENS, SINK_TOKENS)),
    ("tq-k3.5v2.5-qjl", 3.5, 2.5, "prod", (DEFAULT_RECENT_TOKENS, SINK_TOKENS)),
    ("tq3", 4, 2, "mse", (RECENT_TOKENS["tq3"], SINK_TOKENS)),
    ("tq2.5-qjl", 2.5, 2.5, "prod", (RECENT_TOKENS["tq2.5"], SINK_TOKENS)),
    ("tq-k3v3-codes", 3, 3, "mse", (0, 0)),
    ("tq-k2v4-qjl-codes", 2, 4, "prod", (0, 0)),
])
def test_names_give_each_side_its_bits_and_the_window(name, key_bits, value_bits, key_mode, window):
    spec = parse_kv_cache_dtype(name, torch.float32)
    assert (spec.key_bits, spec.value_bits, spec.key_mode) == (key_bits, value_bits, key_mode)
    assert (spec.recent_tokens, spec.sink_tokens) == window


@pytest.mark.parametrize("name", PRESETS)
def test_a_width_name_is_its_best_split_and_costs_no_more_than_both_sides_at_that_width(name):
    spec = parse_kv_cache_dtype(name, torch.float32)
    assert (spec.key_bits, spec.value_bits) == PRESETS[name] and spec.key_bits >= spec.value_bits
    width = name[2:]
    per_token = lambda dtype: KVCache.bytes_per_token_of(SMOLLM2_SHAPES, parse_kv_cache_dtype(dtype, torch.float32))
    assert per_token(name) <= per_token(f"tq-k{width}v{width}")
    assert parse_kv_cache_dtype(f"{name}-qjl", torch.float32).key_mode == "prod"


@pytest.mark.parametrize("name", ["tq-k5v2", "tq-k4", "tq-k4v2.7", "tq3-codes-qjl", "tq-4v2", "bf16"])
def test_unknown_names_are_refused_with_what_is_allowed(name):
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{name}' is not supported; allowed: auto, bfloat16"):
        parse_kv_cache_dtype(name, torch.float32)


def test_a_split_stores_each_side_at_its_own_width():
    """At head_dim 64: a 4-bit key row is 32 code bytes + an fp16 norm, a 2-bit value row 16 + a 1-byte norm."""
    per_token = lambda name: KVCache.bytes_per_token_of(SMOLLM2_SHAPES, parse_kv_cache_dtype(name, torch.float32))
    assert per_token("tq-k4v2") == 30 * 3 * (34 + 17)
    assert per_token("tq-k2v4") == per_token("tq-k4v2") < per_token("tq-k4v3") < per_token("tq-k4v4")


def _cache(name: str, memory: int, **knobs) -> KVCache:
    spec = parse_kv_cache_dtype(name, torch.bfloat16)
    return KVCache(SMOLLM2_SHAPES, spec, torch.bfloat16, memory, 16, torch.device("meta"), max_num_seqs=64, **knobs)


def _staging_blocks(cache: KVCache) -> int:
    return sum(staging.num_staging for staging in cache.stagings.values())


def test_the_default_window_takes_at_most_its_share_of_the_budget_and_explicit_knobs_all_they_need():
    memory = 256 * 2**20
    default, explicit = _cache("tq3", memory), _cache("tq3", memory, recent_tokens=144, sink_tokens=4)
    assert default.recent_tokens == RECENT_TOKENS["tq3"] == 144 and default.sink_tokens == 4
    assert 0 < default.window_memory <= memory // DEFAULT_STAGING_SHARE < explicit.window_memory
    assert _staging_blocks(explicit) == 64 * (10 + 1)  # every sequence: 144 recent tokens span 10 blocks, 4 sinks one
    assert _staging_blocks(_cache("tq3", 2**31)) == _staging_blocks(explicit)  # a budget with room: no cap
    assert _cache("tq3-codes", memory).window_memory == 0
    gemma = KVCache([(1, 256)] * 18, parse_kv_cache_dtype("tq3", torch.bfloat16), torch.bfloat16, memory, 16,
                    torch.device("meta"), max_num_seqs=64, sliding_windows=([512] * 5 + [None]) * 3)
    # sliding layers: 512 tokens span 32 blocks, +1 as it moves; global layers as many recent tokens, +1 sink block
    per_seq = (15 * 33 + 3 * 34) * 16 * 256 * 2 * 2
    assert gemma.layer_windows[:6] == [(512, 0)] * 5 + [(512, 4)]
    assert gemma.window_seqs == memory // DEFAULT_STAGING_SHARE // per_seq and gemma.window_memory == 3 * per_seq
    explicit_gemma = KVCache([(1, 256)] * 18, parse_kv_cache_dtype("tq3", torch.bfloat16), torch.bfloat16, memory, 16,
                             torch.device("meta"), recent_tokens=64, sliding_windows=([512] * 5 + [None]) * 3)
    assert explicit_gemma.layer_windows[5] == (64, 4)  # a recent_tokens given is taken as given
    assert _cache("tq3", memory, recent_tokens=0, sink_tokens=0).window_memory == 0


def test_the_engine_takes_the_names_window_unless_told_otherwise(tiny_llama):
    windowed = LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq-k4v2", kv_cache_memory=2**22)
    assert windowed.engine.kv_cache.layers[0].window.tokens == DEFAULT_RECENT_TOKENS
    assert windowed.engine.kv_cache.layers[0].value_quantizer.bits == 2
    plain = LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq-k4v2", kv_cache_memory=2**22, kv_cache_recent_tokens=0,
                kv_cache_sink_tokens=0)
    assert plain.engine.kv_cache.layers[0].window is None


def test_the_default_window_serves_whole_sequences_or_none():
    assert _staging_blocks(_cache("tq3", 256 * 2**20)) % 11 == 0  # 11 staging blocks a sequence
    tiny = _cache("tq3", 2**23)  # 1/8 of it is less than one sequence's staging: codes alone, all sequences
    assert (tiny.recent_tokens, tiny.sink_tokens, _staging_blocks(tiny), tiny.window_seqs) == (0, 0, 0, 64)


def test_a_default_window_short_of_staging_runs_fewer_sequences_and_outputs_do_not_depend_on_the_batch(tiny_llama):
    """tiny_llama, bf16 staging: 11 blocks x 16 tokens x 2 layers x K+V x 2 heads x 16 x 2 bytes per sequence;
    1/8 of this budget stages two sequences, so two run at once and both read their windows in 16 bits.
    Prefix caching off: a TurboQuant prefill over cached blocks reads them as codes where a first chunk
    reads its own K/V exactly, and a hit block whose staging was since reclaimed is read as codes."""
    memory = 8 * 24 * 16 * 2 * 2 * 2 * 16 * 2
    llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq3", kv_cache_memory=memory, max_num_seqs=6,
              enable_prefix_caching=False)
    assert llm.engine.kv_cache.window_seqs == llm.engine.scheduler.max_num_seqs == 2
    prompts = random_prompts(6, 150, 190, seed=5)  # past the 144-token window: codes are read too
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone



@pytest.mark.parametrize("name,value", [("kv_cache_recent_tokens", -1), ("kv_cache_sink_tokens", 2.5),
                                        ("kv_cache_recent_tokens", True), ("kv_cache_dense_layers", None)])
def test_window_knobs_are_non_negative_integers_or_none_for_the_default(name, value):
    allowed = "must be a non-negative integer" + (" or None" if name != "kv_cache_dense_layers" else "")
    with pytest.raises(ValueError, match=f"{name}={value!r} {allowed}"):
        EngineConfig(model="smollm2-135m", **{name: value}).validate()
