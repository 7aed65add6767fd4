"""Step 1-3 of an AdaFuse round for one model: whole-word span proposals, gated by confidence, with exploration."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import ModelBackend
from .config import FusionConfig
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
    margin: float
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
) -> list[RowProposals]:
    """Every row's candidate spans for this round; all branches of all rows advance in one forward per step."""
    roots = torch.stack(batch.root_logprobs)
    firsts, margins = _margins(roots)
    rows: list[list[_Branch]] = []
    for r, (first, margin) in enumerate(zip(firsts, margins)):
        gated = config.fixed_span_words is not None or margin >= config.tau_delta
        if gated or config.num_branches == 1:
            rows.append([_Branch([first], explored=False, margin=margin)])
        else:
            picks = first_tokens(batch.root_logprobs[r], config, generator)
            rows.append([_Branch([token], explored=True, margin=margin) for token in picks])
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
        next_tokens, next_margins = _margins(torch.stack([batch.logprobs(r, b.node) for r, b in live]))
        for (r, branch), token, margin in zip(live, next_tokens, next_margins):
            _advance(branch, token, margin, backend, config, token_budgets[r], end_ids)

    return [
        RowProposals(
            proposals=[Proposal(b.tokens, b.ends, b.words, b.explored) for b in branches],
            margin=margins[r],
            explored=branches[0].explored,
        )
        for r, branches in enumerate(rows)
    ]


def _advance(branch: _Branch, token: int, margin: float, backend: ModelBackend, config: FusionConfig, budget: int, end_ids: set[int]) -> None:
    """Extend a branch by its greedy next token, or finish it at a word boundary / end token / budget."""
    if token in end_ids:
        branch.ends, branch.done = True, True
        return
    if len(branch.tokens) >= budget:
        branch.done = True
        return
    if bool(backend.starts_word[token]):
        if config.fixed_span_words is not None:
            keep_going = branch.words < config.fixed_span_words
        else:
            keep_going = not branch.explored and branch.margin >= config.tau_delta and branch.words < config.max_span_words
        if not keep_going:
            branch.done = True
            return
        branch.words += 1
        branch.word_tokens = 0
        branch.margin = margin
    elif branch.word_tokens >= config.max_word_tokens:
        branch.done = True
        return
    branch.tokens.append(token)
    branch.word_tokens += 1
