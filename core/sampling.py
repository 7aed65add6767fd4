"""Choosing first tokens to explore: the B most likely, or B distinct draws from a filtered distribution."""
from __future__ import annotations

import torch

from .config import FusionConfig


def filtered_probs(logprobs: torch.Tensor, config: FusionConfig) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to one next-token distribution (renormalised)."""
    probs = torch.softmax(logprobs / config.temperature, dim=-1)
    if config.top_k > 0:
        kth = probs.topk(min(config.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if config.min_p > 0:
        probs = torch.where(probs >= config.min_p * probs.max(), probs, 0.0)
    if config.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > config.top_p * sorted_probs.sum()
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return probs / probs.sum()


def first_tokens(logprobs: torch.Tensor, config: FusionConfig, generator: torch.Generator | None) -> list[int]:
    """The distinct first tokens an exploring model branches on."""
    if config.exploration == "topk":
        return logprobs.topk(config.num_branches).indices.tolist()
    probs = filtered_probs(logprobs, config)
    count = min(config.num_branches, int((probs > 0).sum()))
    return torch.multinomial(probs, count, replacement=False, generator=generator).tolist()
