"""Native RMSNorm and rotary kernels, in every kernel build, against the torch path they replace, bit for bit."""
from __future__ import annotations

import pytest
import torch

from slipstream.backends.cpu import build
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding


def _both_paths(monkeypatch, fn):
    with torch.inference_mode():
        native = fn()
        monkeypatch.setattr(build, "ENABLED", False)
        reference = fn()
    return native, reference


FORMS = {"llama": {}, "cast_last": {"cast_last": True}, "unit_offset": {"unit_offset": True}}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 7, 40])  # 40 rows: the kernel splits rows across threads
def test_rms_norm_kernel_rounds_like_torch(isa, monkeypatch, rows, form):
    torch.manual_seed(0)
    norm = RMSNorm(576, eps=1e-5, **FORMS[form]).bfloat16()
    norm.weight.data.normal_()
    x = (torch.randn(rows, 576) * 3).bfloat16()
    native, reference = _both_paths(monkeypatch, lambda: norm(x))
    assert native.dtype == torch.bfloat16
    # the kernel sums squares in another order; a 1-ulp bf16 difference is possible, rarely
    assert (native != reference).float().mean() < 0.002
    torch.testing.assert_close(native, reference, rtol=0.01, atol=0.01)


def test_rms_norm_kernel_takes_strided_heads(isa, monkeypatch):
    """Gemma 3's q/k norms see heads of a split projection: a strided view, normalised per head."""
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6, unit_offset=True).bfloat16()
    norm.weight.data.normal_()
    q = torch.randn(5, 4 * 64 + 64).bfloat16()[:, :4 * 64].unflatten(-1, (4, 64))
    native, reference = _both_paths(monkeypatch, lambda: norm(q))
    assert native.shape == (5, 4, 64)
    torch.testing.assert_close(native, reference, rtol=0.01, atol=0.01)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_rotary_kernel_rotates_qkv_views_in_place_like_torch(isa, monkeypatch, tokens):
    torch.manual_seed(0)
    rotary = RotaryEmbedding(64, 10000.0)
    qkv = torch.randn(tokens, (9 + 3 + 3) * 64).bfloat16()
    positions = torch.randint(0, 4096, (tokens,))

    def rotate():
        q, k, v = qkv.clone().split([9 * 64, 3 * 64, 3 * 64], dim=-1)
        q, k = rotary(positions, q.view(tokens, 9, 64), k.view(tokens, 3, 64))
        return torch.cat([q.flatten(1), k.flatten(1), v], dim=-1)

    native, reference = _both_paths(monkeypatch, rotate)
    assert not torch.equal(native, qkv)  # it did rotate
    torch.testing.assert_close(native, reference, rtol=0, atol=0)


def test_step_tables_are_the_full_table_s_rows():
    """cos/sin computed for a step's positions are bit for bit the rows of a table over every position."""
    rotary = RotaryEmbedding(64, 10000.0)
    positions = torch.tensor([0, 1, 4095, 17, 8191, 5])
    freqs = torch.outer(torch.arange(8192, dtype=torch.float32), rotary.inv_freq)
    cos, sin = rotary.tables(positions)
    assert torch.equal(cos, freqs.cos()[positions]) and torch.equal(sin, freqs.sin()[positions])


def test_float32_inputs_keep_the_torch_path(isa, monkeypatch):
    norm = RMSNorm(8)
    x = torch.randn(2, 8)
    native, reference = _both_paths(monkeypatch, lambda: norm(x))
    assert torch.equal(native, reference)
