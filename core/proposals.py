"""Step 1-3 of an AdaFuse round for one model: whole-word span proposals, gated by confidence, with exploration."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .backend import ModelBackend
from .config import FusionConfig
from .fusion_gate import GateDecision, GateSession
from .kv_tree import TreeBatch
from .sampling import first_tokens


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


def propose(
    backend: ModelBackend,
    batch: TreeBatch,
    config: FusionConfig,
    token_budgets: list[int],
    generator: torch.Generator | None = None,
    gate: GateSession | None = None,
    model_index: int = 0,
) -> list[RowProposals]:
    """Every row's candidate spans for this round; all branches of all rows advance in one forward per step.

    Whether a model is confident at a word's first token (commit and go on, or explore / end the span) is
    margin >= τΔ, or the learned gate's choice when one is given.
    """
    roots = torch.stack(batch.root_logprobs)
    firsts, margins = _margins(roots)
    decisions: list[list[GateDecision]] = [[] for _ in firsts]
    rows_index = list(range(len(firsts)))
    confident = _confident(gate, model_index, batch, config, token_budgets, roots, margins,
                           [(r, -1, 0) for r in rows_index], decisions)
    rows: list[list[_Branch]] = []
    for r, first in enumerate(firsts):
        if confident[r] or config.num_branches == 1:
            rows.append([_Branch([first], explored=False, confident=confident[r])])
        else:
            picks = first_tokens(batch.root_logprobs[r], config, generator)
            rows.append([_Branch([token], explored=True, confident=False) for token in picks])
    end_ids = set(backend.end_ids)
    for r, branches in enumerate(rows):
        for branch in branches:
            if branch.tokens[0] in end_ids:
                branch.tokens, branch.ends, branch.done = [], True, True

    while True:
        live = [(r, b) for r, branches in enumerate(rows) for b in branches if not b.done]
        if not live:
            break
        requests: list[list[tuple[int, int]]] = [[] for _ in rows]
        for r, branch in live:
            requests[r].append((branch.tokens[-1], branch.node))
        created = batch.feed(requests)
        cursor = [0] * len(rows)
        for r, branch in live:
            branch.node = created[r][cursor[r]]
            cursor[r] += 1
        logprobs = torch.stack([batch.logprobs(r, b.node) for r, b in live])
        next_tokens, next_margins = _margins(logprobs)
        opening = [i for i, ((r, branch), token) in enumerate(zip(live, next_tokens))
                   if _advance(branch, token, backend, config, token_budgets[r], end_ids)]
        if opening:
            new_word = _confident(gate, model_index, batch, config, token_budgets, logprobs[opening],
                                  [next_margins[i] for i in opening],
                                  [(live[i][0], live[i][1].node, live[i][1].words) for i in opening], decisions)
            for i, sure in zip(opening, new_word):
                branch = live[i][1]
                branch.tokens.append(next_tokens[i])
                branch.words, branch.word_tokens, branch.confident = branch.words + 1, 1, sure

    return [
        RowProposals(
            proposals=[Proposal(b.tokens, b.ends, b.words, b.explored) for b in branches],
            margin=margins[r],
            explored=branches[0].explored,
            decisions=decisions[r],
        )
        for r, branches in enumerate(rows)
    ]


def _confident(gate: GateSession | None, model_index: int, batch: TreeBatch, config: FusionConfig,
               token_budgets: list[int], logprobs: torch.Tensor, margins: list[float],
               states: list[tuple[int, int, int]], decisions: list[list[GateDecision]]) -> list[bool]:
    """Confidence at word starts given as (row, node, words already in the span); gate decisions are filed by row."""
    if config.fixed_span_words is not None:
        return [True] * len(states)
    if gate is None:
        return [m >= config.tau_delta for m in margins]
    hidden = torch.stack([batch.root_hidden[r] if node < 0 else batch.rows[r].node_hidden[node] for r, node, _ in states])
    remaining = torch.tensor([token_budgets[r] / config.max_new_tokens for r, _, _ in states])
    words = torch.tensor([w for _, _, w in states])
    sure, made = gate.decide(model_index, hidden, logprobs, remaining, words, config.max_span_words)
    for (r, _, _), decision in zip(states, made):
        decisions[r].append(decision)
    return sure


def _advance(branch: _Branch, token: int, backend: ModelBackend, config: FusionConfig, budget: int, end_ids: set[int]) -> bool:
    """Extend a branch by its greedy next token or finish it at a word boundary / end token / budget.

    Returns True when the token opens a new word the span goes on with (the caller appends it once the
    confidence for that word is known).
    """
    if token in end_ids:
        branch.ends, branch.done = True, True
        return False
    if len(branch.tokens) >= budget:
        branch.done = True
        return False
    if bool(backend.starts_word[token]):
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
