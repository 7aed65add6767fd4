"""KV of recently encoded prompts, so a prompt that begins like one of them skips that part of its prefill."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["CachedPrompt", "PromptPrefixCache", "common_prefix"]


@dataclass
class CachedPrompt:
    """One encoded prompt: its token ids, every layer's keys and values for them ([1, heads, tokens, dim]) and,
    when it was asked for, each token's NLL given the ones before it (NaN where unknown: the first token)."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    token_nll: list[float] | None = None


@dataclass
class PromptPrefixCache:
    """KV of the prompts a model encoded most recently, so new prompts that begin like one of them skip that part.

    Few-shot and RAG prompts share long preambles, and consecutive questions often share their context; reusing
    that KV removes most of the prefill. Each new prompt reuses the entry it shares the longest prefix with.
    """

    min_tokens: int = 16
    max_entries: int = 8
    max_tokens: int = 8192  # all entries together (their KV is a copy per entry)
    entries: list[CachedPrompt] = field(default_factory=list)  # most recent first

    def match(self, prompt: list[int], with_nll: bool = False) -> tuple[CachedPrompt | None, int]:
        """The entry sharing the longest prefix with `prompt`, and that length (at least one prompt token is left to
        run; shorter than `min_tokens` counts as nothing). `with_nll` considers only entries that kept token NLLs."""
        best, longest = None, 0
        for entry in self.entries:
            if with_nll and entry.token_nll is None:
                continue
            shared = common_prefix(entry.ids, prompt, len(prompt) - 1)
            if shared > longest:
                best, longest = entry, shared
        return (best, longest) if longest >= self.min_tokens else (None, 0)

    def followers(self, prompts: list[list[int]], gain: int = 64, with_nll: bool = False) -> list[int]:
        """Rows that share at least `gain` more tokens with an earlier row of their batch than with any cached
        prompt (`with_nll`: any that kept token NLLs, the only ones such a prefill can reuse), so encoding them after
        that row (which gets cached) saves recomputing the shared part."""
        later: list[int] = []
        for i, prompt in enumerate(prompts):
            in_batch = max((common_prefix(prompts[j], prompt, len(prompt) - 1) for j in range(i) if j not in later), default=0)
            if in_batch >= self.match(prompt, with_nll)[1] + gain:
                later.append(i)
        return later

    def store(self, entry: CachedPrompt) -> None:
        """Keep `entry` as the most recent; entries it extends are dropped, and the oldest beyond the limits."""
        kept, total = [entry], len(entry.ids)
        for old in self.entries:
            if common_prefix(old.ids, entry.ids, len(old.ids)) < len(old.ids):
                total += len(old.ids)
                if len(kept) == self.max_entries or total > self.max_tokens:
                    break
                kept.append(old)
        self.entries = kept


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit`."""
    limit = min(limit, len(a), len(b))
    return next((i for i in range(limit) if a[i] != b[i]), max(limit, 0))


