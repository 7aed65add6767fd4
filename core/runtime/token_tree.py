"""What the decoding engine asks of one model over a batch of rows: each row's committed ids and a scratch token
tree on top, the next-token log-distribution after the prefix and after each scratch node, and ways to grow,
commit and drop rows. `TreeBatch` answers from an in-process KV cache; a remote batch from a served model."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

__all__ = ["Node", "Row", "TokenTree"]


@dataclass
class Node:
    """One scratch token: `parent` is a node index or -1 for the committed prefix (cache columns: in-process only)."""

    token: int
    parent: int
    depth: int
    column: int = -1
    ancestor_columns: list[int] = field(default_factory=list)


@dataclass
class Row:
    """One sequence of the batch: its committed token ids and its scratch tree."""

    ids: list[int]
    forwards: int = 0  # forward passes this row fed tokens to
    nodes: list[Node] = field(default_factory=list)
    children: dict[tuple[int, int], int] = field(default_factory=dict)
    node_logprobs: list[torch.Tensor] = field(default_factory=list)
    node_hidden: list[torch.Tensor] = field(default_factory=list)
    prompt_nll: list[float] | None = None  # each prompt token's NLL, when the batch was asked for them

    def add_node(self, token: int, parent: int) -> int:
        """Record a scratch token under `parent`; return its node id."""
        depth = self.nodes[parent].depth + 1 if parent >= 0 else 1
        self.nodes.append(Node(token, parent, depth))
        self.children[(parent, token)] = len(self.nodes) - 1
        return len(self.nodes) - 1

    def path(self, node: int) -> list[int]:
        """The scratch tokens from the committed prefix down to `node`, inclusive."""
        tokens = []
        while node >= 0:
            tokens.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return tokens[::-1]


class TokenTree(ABC):
    """Scratch trees of one model over a batch of rows.

    `root_logprobs[r]` is the next-token log-distribution after row r's committed prefix; `logprobs(r, i)` the
    one after scratch node i.
    """

    rows: list[Row]
    root_logprobs: list[torch.Tensor]
    root_hidden: list[torch.Tensor]
    keep_hidden: bool

    @abstractmethod
    def feed(self, requests: list[list[tuple[int, int]]]) -> list[list[int]]:
        """Run new scratch tokens `(token, parent_node)` for each row in one step; return their node ids."""

    @abstractmethod
    def commit_row(self, row: int, span: list[int]) -> None:
        """Append a span whose tokens are in the row's tree to its committed prefix, and discard its tree."""

    @abstractmethod
    def compact(self, keep_rows: list[int] | None = None, force: bool = False) -> None:
        """Drop the rows not in `keep_rows` (in-process: and reclaim dead cache columns)."""

    @abstractmethod
    def extend(self, other: "TokenTree") -> None:
        """Append the rows of `other` (same model), so prompts can join a running batch."""

    def logprobs(self, row: int, node: int) -> torch.Tensor:
        return self.root_logprobs[row] if node < 0 else self.rows[row].node_logprobs[node]

    def find_path(self, row: int, tokens: list[int]) -> tuple[list[int], int]:
        """Nodes already in row's tree along `tokens`; returns (nodes found, index of first missing token)."""
        found, parent = [], -1
        children = self.rows[row].children
        for token in tokens:
            child = children.get((parent, token))
            if child is None:
                break
            found.append(child)
            parent = child
        return found, len(found)

    def ensure_paths(self, paths: list[list[list[int]]]) -> None:
        """Feed, in one step, whatever tokens of each row's token paths are not yet in its tree."""
        requests = [self.missing(r, row_paths) for r, row_paths in enumerate(paths)]
        if any(requests):
            self.feed(requests)

    def missing(self, row: int, paths: list[list[int]]) -> list[tuple[int, int]]:
        """The `(token, parent)` requests that put every token path in the row's tree (shared prefixes once),
        numbered as `feed` will number them."""
        first_new = len(self.rows[row].nodes)  # node index the first token fed now will get
        planned: dict[tuple[int, ...], int] = {}
        request: list[tuple[int, int]] = []
        for tokens in paths:
            found, start = self.find_path(row, tokens)
            parent = found[-1] if found else -1
            for i in range(start, len(tokens)):
                key = tuple(tokens[: i + 1])
                if key not in planned:
                    planned[key] = first_new + len(request)
                    request.append((tokens[i], parent))
                parent = planned[key]
        return request

    def path_nodes(self, row: int, tokens: list[int]) -> list[int]:
        found, complete = self.find_path(row, tokens)
        if complete != len(tokens):
            raise RuntimeError("scratch tree lacks this token path; ensure_paths must run first")
        return found

    def commit(self, spans: list[list[int] | None]) -> None:
        """Commit each row's span (None drops the row); tokens not yet in a row's tree are run first."""
        self.ensure_paths([[span] if span else [] for span in spans])
        for r, span in enumerate(spans):
            if span is not None:
                self.commit_row(r, span)
        self.compact([r for r, span in enumerate(spans) if span is not None])
