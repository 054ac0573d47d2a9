"""Rejection sampling of draft tokens, so that speculation leaves the target distribution unchanged.

A draft token d proposed with probability q(d) is accepted with probability min(1, p(d) / q(d))
under the target distribution p; where it is rejected the token is drawn from the residual
max(0, p - q), normalised. Our proposers are deterministic (q is a point mass on d), so d is
accepted with probability p(d) and the residual is p without d. `p` is the distribution the
sampler would draw from (after the logits processors, temperature, min_p, top_k, top_p).
Greedy rows need none of this: their draft is accepted where it is the argmax.
"""
from __future__ import annotations

import torch


def residual(probs: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) for a point-mass q on each row's draft: p with the draft removed (unnormalised)."""
    return probs.scatter(1, drafts.unsqueeze(1), 0.0)


def verify(probs: torch.Tensor, drafts: list[int], generators: list[torch.Generator],
           noise: torch.Tensor) -> torch.Tensor:
    """Each row's token: its draft if accepted, else a draw from the residual.

    probs [R, V] are unnormalised target probabilities; noise [R, V] the rows' exponential
    draws, so that argmax(weights / noise) samples in proportion to the weights.
    """
    drafts_t = torch.tensor(drafts, device=probs.device)
    p = probs / probs.sum(-1, keepdim=True)
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(probs.device)
    accept = u < p.gather(1, drafts_t.unsqueeze(1)).squeeze(1)
    redraw = (residual(p, drafts_t) / noise).argmax(-1)
    return torch.where(accept, drafts_t, redraw)
