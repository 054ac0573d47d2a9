"""speculative_config (LLM(...), EngineConfig, --speculative-config): vLLM's names, clear errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from slipstream.config import EngineConfig
from slipstream.speculative.config import SpeculativeConfig


def test_vllm_names_and_defaults():
    config = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    assert EngineConfig.from_kwargs().speculative_config is None


@pytest.mark.parametrize("value, message", [
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2},
     "unknown key(s) ['lookahead']; allowed: ['method', 'num_speculative_tokens'"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle' is not supported; allowed: ['ngram', 'draft_model']"),
    ({"method": "ngram"}, "num_speculative_tokens=None must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens=99 is above 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"}, "prompt_lookup_min='2' must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_max=2 is below prompt_lookup_min=4"),
    ("ngram", "speculative_config='ngram' must be a dict"),
])
def test_bad_values_are_clear_errors(value, message):
    with pytest.raises(ValueError) as e:
        EngineConfig.from_kwargs(speculative_config=value)
    assert message in str(e.value)


@pytest.mark.parametrize("flag, message", [
    ("{method: ngram}", "argument --speculative-config: '{method: ngram}' is not JSON"),
    ('["ngram"]', "must be a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown key(s) ['k']"),
])
def test_bad_cli_flag_fails_before_the_model_loads(flag, message):
    result = subprocess.run([sys.executable, "-m", "slipstream.cli", "serve", "--model", "nope",
                             "--speculative-config", flag], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr
