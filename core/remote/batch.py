"""Scratch token trees over a served model: every node's next-token distribution comes from a completions request
for its prefix (the server's prefix cache keeps shared prefixes from being recomputed), one step's requests sent
side by side.

A server reports only the top k next tokens of a position. The rest of the distribution is filled with the mass
left over, spread evenly (so an unlisted end token still has a finite, small probability), and the exact
log-probability of a token outside the top k is asked for separately when a path goes through it, so candidate
scores are exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..runtime import Row, TokenTree

__all__ = ["Distribution", "NextTokenSource", "RemoteBatch", "RemoteRow"]


@dataclass
class Distribution:
    """A next-token log-distribution: the reported entries, and `floor` in every entry the server did not report."""

    logprobs: torch.Tensor
    floor: float

    @classmethod
    def from_top(cls, top: dict[int, float], vocab_size: int) -> "Distribution":
        ids = torch.tensor(list(top), dtype=torch.long)
        values = torch.tensor(list(top.values()), dtype=torch.float32)
        left = max(1.0 - float(values.exp().sum()), 1e-9)
        floor = float(torch.log(torch.tensor(left / max(vocab_size - len(top), 1))))
        logprobs = torch.full((vocab_size,), floor)
        logprobs[ids] = values
        return cls(logprobs, floor)

    def knows(self, token: int) -> bool:
        return float(self.logprobs[token]) != self.floor


@dataclass
class RemoteRow(Row):
    """A row whose distributions keep their floors: `root` after the committed prefix, one per scratch node."""

    root: Distribution | None = None
    node_distributions: list[Distribution] = field(default_factory=list)


class NextTokenSource(Protocol):
    """What a remote batch asks of its backend (`RemoteBackend`)."""

    counters: dict[str, int]

    def next_tokens(self, prefixes: list[list[int]]) -> list[Distribution]: ...

    def token_logprobs(self, queries: list[tuple[list[int], int]]) -> list[float]: ...


class RemoteBatch(TokenTree):
    """Rows of prompts decoding on one served model; no state lives on the server but its prefix cache."""

    def __init__(self, backend: NextTokenSource, rows: list[RemoteRow]):
        self.backend, self.rows = backend, rows
        self.keep_hidden, self.root_hidden = False, []

    @property
    def root_logprobs(self) -> list[torch.Tensor]:
        return [row.root.logprobs for row in self.rows]

    def logprobs(self, row: int, node: int) -> torch.Tensor:
        state = self.rows[row]
        return (state.root if node < 0 else state.node_distributions[node]).logprobs

    def _distribution(self, row: RemoteRow, node: int) -> Distribution:
        return row.root if node < 0 else row.node_distributions[node]

    def feed(self, requests: list[list[tuple[int, int]]]) -> list[list[int]]:
        """Ask the server, for every new node at once, what follows it; then, for nodes whose token the parent's
        top k did not list, that token's exact log-probability."""
        created, asked = [], []
        for row, request in zip(self.rows, requests):
            row.forwards += bool(request)
            nodes = [row.add_node(token, parent) for token, parent in request]
            created.append(nodes)
            asked += [(row, node) for node in nodes]
        answers = self.backend.next_tokens([row.ids + row.path(node) for row, node in asked])
        for (row, _), distribution in zip(asked, answers):
            row.node_distributions.append(distribution)
        unlisted = [(row, node) for row, node in asked
                    if not self._distribution(row, row.nodes[node].parent).knows(row.nodes[node].token)]
        if unlisted:
            exact = self.backend.token_logprobs(
                [(row.ids + row.path(row.nodes[node].parent), row.nodes[node].token) for row, node in unlisted])
            for (row, node), value in zip(unlisted, exact):
                self._distribution(row, row.nodes[node].parent).logprobs[row.nodes[node].token] = value
        self.backend.counters["forward_passes"] += 1
        self.backend.counters["tokens"] += len(asked)
        return created

    def commit_row(self, row: int, span: list[int]) -> None:
        nodes = self.path_nodes(row, span)
        state = self.rows[row]
        if nodes:
            state.root = state.node_distributions[nodes[-1]]
        state.ids.extend(span)
        state.nodes, state.children, state.node_distributions = [], {}, []

    def compact(self, keep_rows: list[int] | None = None, force: bool = False) -> None:
        if keep_rows is not None:
            self.rows = [self.rows[r] for r in keep_rows]

    def extend(self, other: "TokenTree") -> None:
        if not isinstance(other, RemoteBatch) or other.backend is not self.backend:
            raise TypeError("a remote batch can only be extended with rows of the same served model")
        self.rows += other.rows
