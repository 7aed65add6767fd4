"""How much each model's NLL counts in the fused score of one prompt's candidates.

"mean" is the paper's rule: fixed weights (`model_weights`, equal by default). "competence" scales them, per
prompt, by how well each model predicts the prompt's own demonstrations: the spans that follow earlier
occurrences of the cue the prompt ends with (the few-shot answers after "Answer:", earlier assistant turns), or,
in a prompt without any (zero-shot), the whole prompt. A model that predicts worked answers of this task worse
than another is less likely to be right about the next one, and its confident candidates should not outvote
the other's. It needs no labels: only prompt tokens' NLLs, scored in the prefill that encodes the prompt.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["competence_weights", "demonstration_spans", "nats_per_char", "scored_tokens"]


def demonstration_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the prompt's demonstrations: after each earlier line-initial occurrence of the prompt's
    last line (its cue, e.g. "Answer:"), up to the next blank line."""
    body = text.rstrip()
    cue = body.rsplit("\n", 1)[-1].strip()
    if len(cue) < 2:
        return []
    spans, start, end = [], 0, len(body) - len(cue)
    while (found := text.find(cue, start, end)) >= 0:
        start = found + len(cue)
        if found == 0 or text[found - 1] == "\n":
            stop = text.find("\n\n", start + 1, end)
            spans.append((start, end if stop < 0 else stop))
    return spans


def scored_tokens(text: str, offsets: Sequence[tuple[int, int]] | None) -> list[bool]:
    """Which prompt tokens (by their character offsets) measure competence: those starting inside a
    demonstration, or every token of a prompt without any (none where the offsets are unknown)."""
    spans = demonstration_spans(text)
    return [end > begin and (not spans or any(a <= begin < b for a, b in spans)) for begin, end in offsets or []]


def nats_per_char(token_nll: Sequence[float], scored: Sequence[bool], offsets: Sequence[tuple[int, int]] | None) -> float:
    """A model's NLL per character of the scored tokens: comparable across tokenizers, as every model reads the
    same text. Tokens whose NLL is unknown (NaN: the first) are left out; NaN when nothing is scored."""
    total = chars = 0.0
    for value, keep, (begin, end) in zip(token_nll, scored, offsets or []):
        if keep and not math.isnan(value):
            total, chars = total + value, chars + end - begin
    return total / chars if chars else math.nan


def competence_weights(prior: torch.Tensor, nats: Sequence[float], sharpness: float) -> torch.Tensor:
    """`prior * exp(-sharpness * (nats - min nats))`, normalised: a model 0.1 nats/char worse than the best one
    counts exp(-0.1 * sharpness) times as much. Unknown competence (NaN) leaves the prior."""
    values = torch.tensor(list(nats), dtype=prior.dtype)
    if values.isnan().any():
        return prior
    weights = prior * torch.exp(-sharpness * (values - values.min()))
    return weights / weights.sum()
