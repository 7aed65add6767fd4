"""Scoring candidates: each model's NLL of a span, and how much each model's NLL counts in the fused score.

"mean" is the paper's rule: fixed weights (`model_weights`, equal by default). "competence" scales them, per
prompt, by how well each model predicts the prompt's own demonstrations: the spans that follow earlier
occurrences of the cue the prompt ends with (the few-shot answers after "Answer:", earlier assistant turns), or,
in a prompt without any (zero-shot), its instructions: every line before the input to answer, which is the last
line, or the last two when the last is a cue ending in a colon ("Question: ...\nAnswer:"). A prompt that is only
its input has no instructions, so its weights stay the prior. The input itself is left out because a model that
merely knows its language (the German source of a translation) is not thereby better at the task. A model that
predicts worked answers of this task worse than another is less likely to be right about the next one, and its
confident candidates should not outvote the other's. It needs no labels: only prompt tokens' NLLs, scored in
the prefill that encodes the prompt.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..backend import Backend
from ..prompts import Prompt
from ..runtime import TokenTree
from .state import CompetenceMarks

__all__ = ["chosen_candidate", "competence_marks", "competence_weights", "confident_weights", "demonstration_spans",
           "instructions_end", "nats_per_char", "row_weights", "scored_tokens", "span_nll", "total_nll"]


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
    demonstration or, in a prompt without any, in its instructions; none where the offsets are unknown."""
    spans = demonstration_spans(text) or [(0, instructions_end(text))]
    return [end > begin and any(a <= begin < b for a, b in spans) for begin, end in offsets or []]


def instructions_end(text: str) -> int:
    """Where a zero-shot prompt's instructions end: at the start of its input, the last line, or the last two
    when the last is a cue ending in a colon (its question line and "Answer:"); 0 when the input is all there is."""
    lines = text.rstrip().split("\n")
    input_lines = 2 if lines[-1].rstrip().endswith(":") else 1
    return len("\n".join(lines[:-input_lines])) + 1 if len(lines) > input_lines else 0


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
    counts exp(-0.1 * sharpness) times as much. Unknown competence (NaN, or infinite for every model) leaves the
    prior."""
    values = torch.tensor(list(nats), dtype=prior.dtype)
    if values.isnan().any():
        return prior
    weights = prior * torch.exp(-sharpness * (values - values.min()))
    total = weights.sum()
    return weights / total if torch.isfinite(total) and total > 0 else prior


def confident_weights(weights: torch.Tensor, nll: Sequence[Sequence[float]], sharpness: float) -> torch.Tensor:
    """One round's weights: each model's, scaled by exp(-sharpness * its NLL of its likeliest candidate), normalised.
    A model that is sure of some candidate keeps its weight; one that finds every candidate unlikely gives way in
    this round, however well it read the demonstrations. Off by default: a weak model can be sure and wrong
    (SmolLM2 on SQuAD, `reports/eval/RUNS.md`)."""
    if sharpness == 0 or len(nll) < 2:
        return weights
    return competence_weights(weights, torch.tensor(nll, dtype=weights.dtype).min(dim=0).values.tolist(), sharpness)


def chosen_candidate(nll: Sequence[Sequence[float]], fused: Sequence[float], weights: torch.Tensor,
                     veto_margin: float | None) -> int:
    """Index of the candidate with the lowest fused score among those the most-weighted model (the first on a tie)
    does not veto: with a `veto_margin`, a candidate whose NLL under that model exceeds the model's NLL of its
    favourite candidate by more than the margin cannot win, so weaker models can only choose among spans the
    trusted one finds nearly as likely as its own best."""
    allowed = list(range(len(fused)))
    if veto_margin is not None and len(fused) > 1:
        lead = int(torch.argmax(weights))
        best = min(row[lead] for row in nll)
        allowed = [c for c in allowed if nll[c][lead] <= best + veto_margin]
    return min(allowed, key=lambda c: fused[c])


def span_nll(backend: Backend, batch: TokenTree, row: int, tokens: list[int], text: str, ends: bool,
             normalization: str) -> float:
    """A candidate's NLL under one model, per token (the paper), per character (the same unit for every tokenizer)
    or in total (the joint probability of the span); the end token counts as one of each."""
    total = total_nll(backend, batch, row, tokens, ends)
    per = {"token": len(tokens), "char": len(text), "total": 0}[normalization] + ends
    return total / max(per, 1)


def total_nll(backend: Backend, batch: TokenTree, row: int, tokens: list[int], ends: bool) -> float:
    """NLL of a span (plus the end token when it ends) under this model, given the row's prefix; the span's tokens
    must be in the row's scratch tree."""
    nodes = batch.path_nodes(row, tokens)
    parents = [-1] + nodes[:-1]
    total = sum(float(batch.logprobs(row, p)[t]) for p, t in zip(parents, tokens))
    if ends:
        total += float(backend.end_logprob(batch.logprobs(row, nodes[-1] if nodes else -1)))
    return -total


def competence_marks(backends: Sequence[Backend], prompt: Prompt) -> CompetenceMarks:
    """Per model, which of the prompt's tokens measure competence (so the prefill scores only those) and their
    character offsets."""
    marks = []
    for backend in backends:
        text = backend.render(prompt)
        offsets = backend.prompt_offsets(text)
        marks.append((scored_tokens(text, offsets), offsets))
    return marks


def row_weights(prior: torch.Tensor, batches: Sequence[TokenTree], position: int,
                marks: CompetenceMarks | None, sharpness: float) -> torch.Tensor:
    """The weights of one prompt's fused scores: the prior, scaled by each model's competence on the prompt (the
    prior itself when competence is not scored)."""
    if marks is None:
        return prior
    nats = [nats_per_char(batch.rows[position].prompt_nll or [], scored, offsets)
            for batch, (scored, offsets) in zip(batches, marks)]
    return competence_weights(prior, nats, sharpness)
