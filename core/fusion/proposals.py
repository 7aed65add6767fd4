"""Step 1-3 of an AdaFuse round for one model: whole-word span proposals, gated by confidence, with exploration."""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from ..backend import Backend
from ..config import FusionConfig
from ..sampling.filters import filtered_probs
from .gate import GateDecision, GateSession

__all__ = ["Proposal", "RowProposals", "first_tokens", "propose_row"]


@dataclass
class Proposal:
    """A candidate span from one model: its tokens (end token excluded) and whether the model then ends."""

    tokens: list[int]
    ends: bool = False
    words: int = 1
    explored: bool = False


@dataclass
class _Branch:
    tokens: list[int]
    explored: bool
    confident: bool  # whether the span may go on after the current word
    node: int = -1
    words: int = 1
    word_tokens: int = 1
    ends: bool = False
    done: bool = False


@dataclass
class RowProposals:
    proposals: list[Proposal]
    margin: float
    explored: bool
    decisions: list[GateDecision] = field(default_factory=list)


def _margins(logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Argmax token and top-2 probability margin of each row of a [n, V] log-prob matrix."""
    top = logprobs.topk(2, dim=-1)
    probs = top.values.exp()
    return top.indices[:, 0].tolist(), (probs[:, 0] - probs[:, 1]).tolist()


# Feedback for a row's scratch tokens after a forward: their node ids, log-distributions [n, V] and final-layer
# states [n, H] (None unless the batch keeps them, for a learned gate).
Feedback = tuple[list[int], torch.Tensor, "torch.Tensor | None"]
Requests = list[tuple[int, int]]


def propose_row(
    backend: Backend,
    root_logprobs: torch.Tensor,
    root_hidden: torch.Tensor | None,
    config: FusionConfig,
    token_budget: int,
    generator: torch.Generator | None = None,
    gate: GateSession | None = None,
    model_index: int = 0,
    min_tokens: int = 0,
) -> Generator[Requests, Feedback, RowProposals]:
    """One row's candidate spans for this round, as a coroutine: it yields the scratch tokens `(token, parent
    node)` its branches need next and is sent back what the forward gave them, so the caller can run every
    row's needs (whatever phase each row is in) in one forward per step.

    Whether a model is confident at a word's first token (commit and go on, or explore / end the span) is
    margin >= τΔ, or the learned gate's choice when one is given. A span may not end before it has `min_tokens`
    tokens: until then the end tokens are taken out of the model's distributions (`min_new_tokens`).
    """
    if min_tokens > 0:
        root_logprobs = backend.without_end(root_logprobs)
    firsts, margins = _margins(root_logprobs[None])
    decisions: list[GateDecision] = []
    confident = _confident(gate, model_index, config, token_budget, root_logprobs[None], margins,
                           None if root_hidden is None else root_hidden[None], [0], decisions)[0]
    if confident or config.num_branches == 1:
        branches = [_Branch([firsts[0]], explored=False, confident=confident)]
    else:
        branches = [_Branch([token], explored=True, confident=False) for token in first_tokens(root_logprobs, config, generator)]
    end_ids = set(backend.end_ids)
    for branch in branches:
        if branch.tokens[0] in end_ids:
            branch.tokens, branch.ends, branch.done = [], True, True

    while live := [b for b in branches if not b.done]:
        nodes, logprobs, hidden = yield [(branch.tokens[-1], branch.node) for branch in live]
        for branch, node in zip(live, nodes):
            branch.node = node
        if short := [i for i, branch in enumerate(live) if len(branch.tokens) < min_tokens]:
            rows = torch.tensor(short, device=logprobs.device)
            logprobs = logprobs.index_copy(0, rows, backend.without_end(logprobs[rows]))
        next_tokens, next_margins = _margins(logprobs)
        opening = [i for i, (branch, token) in enumerate(zip(live, next_tokens))
                   if _advance(branch, token, backend, config, token_budget, end_ids)]
        if opening:
            new_word = _confident(gate, model_index, config, token_budget, logprobs[opening],
                                  [next_margins[i] for i in opening], None if hidden is None else hidden[opening],
                                  [live[i].words for i in opening], decisions)
            for i, sure in zip(opening, new_word):
                branch = live[i]
                branch.tokens.append(next_tokens[i])
                branch.words, branch.word_tokens, branch.confident = branch.words + 1, 1, sure

    return RowProposals(
        proposals=[Proposal(b.tokens, b.ends, b.words, b.explored) for b in branches],
        margin=margins[0],
        explored=branches[0].explored,
        decisions=decisions,
    )


def first_tokens(logprobs: torch.Tensor, config: FusionConfig, generator: torch.Generator | None) -> list[int]:
    """The distinct first tokens an exploring model branches on: the B most likely, or B distinct draws from the
    filtered distribution."""
    if config.exploration == "topk":
        return logprobs.topk(config.num_branches).indices.tolist()
    probs = filtered_probs(logprobs, config.sampling_filter)
    count = min(config.num_branches, int((probs > 0).sum()))
    return torch.multinomial(probs, count, replacement=False, generator=generator).tolist()


def _confident(gate: GateSession | None, model_index: int, config: FusionConfig, token_budget: int,
               logprobs: torch.Tensor, margins: list[float], hidden: torch.Tensor | None, words: list[int],
               decisions: list[GateDecision]) -> list[bool]:
    """Confidence at n word starts (words already in each span given); the gate's decisions are appended."""
    if config.fixed_span_words is not None:
        return [True] * len(margins)
    if gate is None:
        return [m >= config.tau_delta for m in margins]
    remaining = torch.full((len(margins),), token_budget / config.max_new_tokens)
    sure, made = gate.decide(model_index, hidden, logprobs, remaining, torch.tensor(words), config.max_span_words)
    decisions.extend(made)
    return sure


def _advance(branch: _Branch, token: int, backend: Backend, config: FusionConfig, budget: int, end_ids: set[int]) -> bool:
    """Extend a branch by its greedy next token or finish it at a word boundary / end token / budget.

    Returns True when the token opens a new word the span goes on with (the caller appends it once the
    confidence for that word is known). A word that is only whitespace so far goes on through a word start.
    """
    if token in end_ids:
        branch.ends, branch.done = True, True
        return False
    if len(branch.tokens) >= budget:
        branch.done = True
        return False
    if bool(backend.starts_word[token]) and not _word_is_blank(branch, backend):
        if config.fixed_span_words is not None:
            keep_going = branch.words < config.fixed_span_words
        else:
            keep_going = not branch.explored and branch.confident and branch.words < config.max_span_words
        if not keep_going:
            branch.done = True
        return keep_going
    if branch.word_tokens >= config.max_word_tokens:
        branch.done = True
        return False
    branch.tokens.append(token)
    branch.word_tokens += 1
    return False


def _word_is_blank(branch: _Branch, backend: Backend) -> bool:
    """Whether the branch's current word is only whitespace so far (its last `word_tokens` tokens)."""
    return bool(backend.blank[branch.tokens[-branch.word_tokens:]].all())
