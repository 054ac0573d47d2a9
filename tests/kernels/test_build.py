"""Building native kernels: failures fall back to the torch path, never to an error."""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from slipstream.backends.cpu import build as kernels


def test_a_failing_compiler_means_no_kernel_and_a_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(kernels, "COMPILER", "false")
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        assert kernels._load.__wrapped__("norm") is None
    assert "native kernel norm not built" in caplog.text


def test_kernels_build_into_the_cache_dir_and_load(monkeypatch, tmp_path):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    lib = kernels._load.__wrapped__("norm")
    assert lib is not None and hasattr(lib, "rms_norm_bf16")
    assert [p.name.split("-")[0] for p in (tmp_path / "slipstream-kernels").iterdir()] == ["norm"]


def test_an_unwritable_cache_dir_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(blocker / "below"))
    assert kernels._cache_dir() == Path(tempfile.gettempdir()) / "slipstream-kernels"
