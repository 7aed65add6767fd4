"""Sampling filters applied to one next-token distribution."""
from __future__ import annotations

import torch

from ..config import SamplingFilter

__all__ = ["filtered_probs"]


def filtered_probs(logprobs: torch.Tensor, settings: SamplingFilter) -> torch.Tensor:
    """Temperature (positive: greedy needs no filter), top-k, top-p and min-p applied to one next-token distribution
    (renormalised)."""
    probs = torch.softmax(logprobs / settings.temperature, dim=-1)
    if settings.top_k > 0:
        kth = probs.topk(min(settings.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if settings.min_p > 0:
        probs = torch.where(probs >= settings.min_p * probs.max(), probs, 0.0)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > settings.top_p * sorted_probs.sum()
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return probs / probs.sum()
