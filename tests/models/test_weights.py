"""Checkpoint naming: per-expert tensors stacked into the experts' layout."""
from __future__ import annotations

import pytest
import torch

from slipstream.models.weights import stack_expert_weights


def test_stack_expert_weights_matches_manual_stack():
    g = torch.Generator().manual_seed(0)
    tensors = {f"m.experts.{e}.{p}.weight": torch.randn(3, 2, generator=g) for e in range(2) for p in ("w1", "w3")}
    tensors.update({f"m.experts.{e}.w2.weight": torch.randn(2, 3, generator=g) for e in range(2)})
    tensors["m.gate.weight"] = torch.randn(2, 2, generator=g)
    out = dict(stack_expert_weights(tensors.items(), num_experts=2))
    assert set(out) == {"m.experts.gate_up_proj", "m.experts.down_proj", "m.gate.weight"}
    for e in range(2):
        assert torch.equal(out["m.experts.gate_up_proj"][e],
                           torch.cat([tensors[f"m.experts.{e}.w1.weight"], tensors[f"m.experts.{e}.w3.weight"]]))
        assert torch.equal(out["m.experts.down_proj"][e], tensors[f"m.experts.{e}.w2.weight"])


def test_stack_expert_weights_rejects_missing_expert():
    tensors = [(f"m.experts.0.{p}.weight", torch.zeros(3, 2)) for p in ("gate_proj", "up_proj", "down_proj")]
    with pytest.raises(ValueError, match="incomplete set of expert tensors"):
        list(stack_expert_weights(tensors, num_experts=2))
