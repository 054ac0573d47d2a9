"""Bad input gets a clear error naming the value and what is allowed; nothing else is disturbed."""
from __future__ import annotations

import json
import os

import pytest

from slipstream import LLM, SamplingParams


def test_unknown_model_lists_what_is_supported():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'.*smollm2-135m"):
        LLM("no-such-model")


def test_missing_file_and_wrong_extension(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        LLM(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        LLM(str(bad))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        LLM(str(bad))


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(ValueError, match="'FooForCausalLM'.*not supported; supported: .*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_directory_without_weights_never_loads_pickles(tmp_path, tiny_llama):
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_llama, "config.json")).read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="no \\*.safetensors files"):
        LLM(str(tmp_path))


def test_bad_engine_arguments(tiny_llama):
    with pytest.raises(TypeError, match="unknown engine argument.*'max_seqs'"):
        LLM(tiny_llama, max_seqs=4)
    with pytest.raises(ValueError, match="dtype='float16' is not supported"):
        LLM(tiny_llama, dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype=.int3. is not supported; allowed: auto, bfloat16"):
        LLM(tiny_llama, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="block_size=0 must be a positive integer"):
        LLM(tiny_llama, block_size=0)
    with pytest.raises(ValueError, match="too small for one block"):
        LLM(tiny_llama, kv_cache_memory=100)


@pytest.fixture(scope="module")
def small(tiny_llama):
    return LLM(tiny_llama, dtype="float32", max_model_len=64, kv_cache_memory=2 * 2 * 2 * 16 * 4 * 16 * 3)


@pytest.mark.parametrize("prompt,params,message", [
    (list(range(3, 70)), None, "prompt has 67 tokens; max_model_len is 64"),
    (list(range(3, 40)), SamplingParams(max_tokens=40), "exceeds max_model_len \\(64\\)"),
    (list(range(3, 30)), SamplingParams(max_tokens=30), "can never fit in the KV cache \\(3 blocks = 48 tokens\\)"),
    ([], None, "prompt is empty"),
    ([5, 100000], None, "prompt: token id\\(s\\) \\[100000\\] out of range; allowed: 0..383"),
    ([5, 6], SamplingParams(stop_token_ids=[400], min_tokens=1), "stop_token_ids: token id\\(s\\) \\[400\\] out of range"),
    ([5, 6], SamplingParams(logit_bias={384: 5.0}), "logit_bias: token id\\(s\\) \\[384\\] out of range"),
    ([5, 6], SamplingParams(allowed_token_ids=[3, 999]), "allowed_token_ids: token id\\(s\\) \\[999\\] out of range"),
    ("text", None, "no tokenizer is loaded"),
    ({"a": 1}, None, "prompt must be a string or a list of token ids"),
], ids=["longer-than-model", "plus-max-tokens", "cache-too-small", "empty", "bad-token", "bad-stop-token",
        "bad-bias-token", "bad-allowed-token", "no-tokenizer", "bad-type"])
def test_requests_that_can_never_run_are_rejected(small, prompt, params, message):
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        small.generate([[5, 6, 7], prompt], [good, params or SamplingParams(max_tokens=None)], use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
    assert small.stats()["num_used_blocks"] == 0
    out = small.generate([[5, 6, 7]], good, use_tqdm=False)  # the engine still works
    assert len(out[0].outputs[0].token_ids) == 4


def test_unbounded_max_tokens_fit_the_cache_and_huge_seeds_work(small):
    out = small.generate([[5, 6, 7]], SamplingParams(max_tokens=None, ignore_eos=True, seed=10**30), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 48 - 3  # the cache (48 tokens) is smaller than max_model_len (64)


def test_mismatched_params_list(small):
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        small.generate([[5], [6]], [SamplingParams()], use_tqdm=False)
