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
