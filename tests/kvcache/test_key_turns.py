"""TurboQuant calibration under rotary embeddings: a mean key that turns with position.

SmolLM2 keeps most of its key energy as a near-constant vector in a few slow rotary pairs; rotary
turns it with position, so a mean measured on the calibration prompt's first positions is wrong
far beyond them. These tests build such keys, calibrate on positions 0..255 and read codes at the
far end of an 8k context.
"""
from __future__ import annotations

import torch

from slipstream import LLM
from slipstream.kvcache.turboquant_cache import STEADY_TURN, TurboQuantLayerCache
from slipstream.layers.rotary import RotaryEmbedding

DIM, HEADS, CONTEXT = 64, 2, 8192
ROTARY = RotaryEmbedding(DIM, 100_000.0)  # SmolLM2's head size and base


def _keys(positions: torch.Tensor, seed: int) -> torch.Tensor:
    """Rotated keys [T, HEADS, DIM] whose pre-rotary form is a large constant in pairs 20 and 23 plus noise."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(positions), HEADS, DIM, generator=g)
    for pair, size in ((20, 12.0), (23, 9.0)):
        k[..., pair] += size
        k[..., pair + DIM // 2] += size / 2
    q = torch.randn(len(positions), 2 * HEADS, DIM, generator=g)
    q, k = ROTARY(positions, q, k)
    return q, k


def _cache(key_turns: torch.Tensor | None) -> TurboQuantLayerCache:
    return TurboQuantLayerCache(64, 16, HEADS, DIM, 4, "mse", seed=1, device=torch.device("cpu"), key_turns=key_turns)


def _relative_error(cache: TurboQuantLayerCache, k: torch.Tensor) -> float:
    slots = torch.arange(len(k))
    cache.write(k, k, slots)
    keys, _ = cache.gather(torch.arange(64), len(k), torch.float32)
    return ((keys.transpose(0, 1) - k).norm(dim=-1) / k.norm(dim=-1)).mean().item()


def test_far_keys_keep_their_accuracy_when_the_cache_knows_how_its_keys_turn():
    q, k = _keys(torch.arange(256), seed=0)
    far = _keys(torch.arange(CONTEXT - 512, CONTEXT), seed=1)[1]
    near = _keys(torch.arange(256, 768), seed=2)[1]
    errors = {}
    for name, turns in (("told", ROTARY.inv_freq * CONTEXT), ("not told", None)):
        cache = _cache(turns)
        cache.calibrate(q, k, k)
        errors[name] = _relative_error(cache, near), _relative_error(_copy_calibration(cache, turns), far)
    told, untold = errors["told"], errors["not told"]
    # measured: told 0.058 near and far; not told 0.045 near (its mean still holds there), 0.094 far
    assert untold[1] > 1.8 * untold[0], errors  # the drift this guards against: a stale mean swamps far keys
    assert told[1] < 1.1 * told[0] and told[1] < 0.75 * untold[1], errors


def _copy_calibration(cache: TurboQuantLayerCache, turns) -> TurboQuantLayerCache:
    """A fresh cache with the same constants (write() above filled the first one's slots)."""
    fresh = _cache(turns)
    fresh.key_mean, fresh.key_scale, fresh.calibrated = cache.key_mean, cache.key_scale, True
    return fresh


def test_mean_kept_on_steady_pairs_only_and_scales_tied_within_each_pair():
    q, k = _keys(torch.arange(256), seed=0)
    turns = ROTARY.inv_freq * CONTEXT
    cache = _cache(turns)
    cache.calibrate(q, k, k)
    steady = torch.cat([turns, turns]) < STEADY_TURN
    assert 0 < steady.sum() < DIM
    assert torch.equal(cache.key_mean[:, ~steady], torch.zeros_like(cache.key_mean[:, ~steady]))
    assert torch.equal(cache.key_mean[:, steady], k.mean(0)[:, steady])
    assert torch.equal(cache.key_scale[:, :DIM // 2], cache.key_scale[:, DIM // 2:])


def test_the_engine_tells_each_layer_how_far_its_keys_turn(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", kv_cache_dtype="tq4", kv_cache_memory=2**22, max_model_len=100)
    attn = llm.engine.runner.model.attention_layers()[0]
    layer = llm.engine.kv_cache.layers[0]
    assert torch.equal(layer.key_turns, attn.key_rotation * 100)
