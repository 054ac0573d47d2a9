"""The CLI on the default model, run as a user would run it."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_generate_chat_mentions_paris():
    result = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "generate", "--chat", "What is the capital of France?",
         "--temperature", "0", "--max-tokens", "32"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "TTFT" in result.stderr and "tok/s" in result.stderr


def test_bad_flag_value_is_a_clear_error():
    result = subprocess.run([sys.executable, "-m", "slipstream.cli", "generate", "hi", "--model", "nope"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown model 'nope'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("flags,message", [
    (["--shutdown-timeout", "-1"], "--shutdown-timeout -1.0 is invalid"),
    (["--max-stop-strings", "0"], "max_stop_strings=0 must be a positive integer"),
    (["--api-key", ""], "--api-key is set but empty"),
])
def test_bad_serve_flag_fails_before_the_model_loads(flags, message):
    result = subprocess.run([sys.executable, "-m", "slipstream.cli", "serve", "--model", "nope", *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
