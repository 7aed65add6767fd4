"""A batch of sequences sharing one model's KV cache, each with a scratch token tree on top.

Every row holds its committed prefix (left-padded) followed by scratch tokens: proposals, exploration
branches and candidates under scoring. A scratch token attends to its row's committed prefix and its own
ancestors only, so many branches and candidates go through the model in one forward pass over the cached
prefix. Committing a chosen span moves the cache columns of its tokens into the row's committed prefix and masks
off the rest of its tree, so no token of the shared prefix is ever encoded twice. Rows commit independently (one
row can commit while others hold trees); the dead columns are reclaimed by an occasional compaction, not a
copy per commit.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from .model_runner import ModelRunner
from .token_tree import Row, TokenTree

__all__ = ["TreeBatch"]


class TreeBatch(TokenTree):
    """KV cache and scratch trees of one in-process model over a batch of rows."""

    def __init__(self, runner: ModelRunner, cache: DynamicCache, rows: list[Row], root_logprobs: list[torch.Tensor],
                 root_hidden: list[torch.Tensor], column_positions: torch.Tensor, committed: torch.Tensor,
                 pad_token_id: int, keep_hidden: bool = False):
        self.runner, self.cache, self.rows = runner, cache, rows
        self.root_logprobs, self.root_hidden = root_logprobs, root_hidden
        self.column_positions = column_positions  # batch x columns: each cache column's position
        self.committed = committed  # batch x columns: the columns of each row's committed prefix
        self.pad_token_id = pad_token_id
        self.keep_hidden = keep_hidden  # final-layer states, for policies that read them (TokenAdapter)
        self.device = runner.device

    @torch.inference_mode()
    def feed(self, requests: list[list[tuple[int, int]]]) -> list[list[int]]:
        batch, existing = len(self.rows), self.committed.shape[1]
        width = self.runner.step_width(batch, max(len(r) for r in requests))
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        wanted = torch.zeros((batch, width), dtype=torch.bool)
        allowed = torch.zeros((batch, width, existing + width), dtype=torch.bool)
        allowed[:, :, :existing] = self.committed[:, None, :].cpu()
        created: list[list[int]] = []
        for r, (row, request) in enumerate(zip(self.rows, requests)):
            created.append([])
            row.forwards += bool(request)
            for k, (token, parent) in enumerate(request):
                column = existing + k
                node = row.add_node(token, parent)
                ancestors = (row.nodes[parent].ancestor_columns if parent >= 0 else []) + [column]
                row.nodes[node].column, row.nodes[node].ancestor_columns = column, ancestors
                created[r].append(node)
                input_ids[r, k] = token
                wanted[r, k] = True
                positions[r, k] = len(row.ids) + row.nodes[node].depth - 1
                allowed[r, k, ancestors] = True
            for k in range(len(request), width):
                allowed[r, k, existing + k] = True  # padding attends to itself only
        column_positions = torch.cat([self.column_positions, positions.to(self.device)], dim=1)
        output = self.runner.run(self.cache, input_ids, self.runner.attention_masks(allowed, positions, column_positions),
                                 positions, wanted, wanted, keep_hidden=self.keep_hidden)
        logprobs = output.logprobs
        start = 0
        for r, nodes in enumerate(created):
            self.rows[r].node_logprobs.extend(logprobs[start : start + len(nodes)])
            if self.keep_hidden:
                self.rows[r].node_hidden.extend(output.hidden[start : start + len(nodes)])
            start += len(nodes)
        self.column_positions = column_positions
        self.committed = torch.cat([self.committed, torch.zeros((batch, width), dtype=torch.bool, device=self.device)], 1)
        self.runner.counters["tokens"] += sum(len(r) for r in requests)
        return created

    # ------------------------------------------------------------------ commit
    @torch.inference_mode()
    def commit_row(self, row: int, span: list[int]) -> None:
        """No cache copy: the span's columns join the row's committed mask and the rest of its tree is masked off;
        `compact` reclaims the dead columns when they pile up.
        """
        nodes = self.path_nodes(row, span)
        state = self.rows[row]
        if nodes:
            columns = torch.tensor([state.nodes[n].column for n in nodes], device=self.device)
            self.committed[row, columns] = True
            self.root_logprobs[row] = state.node_logprobs[nodes[-1]]
            if self.keep_hidden:
                self.root_hidden[row] = state.node_hidden[nodes[-1]]
        state.ids.extend(span)
        state.nodes, state.children, state.node_logprobs, state.node_hidden = [], {}, [], []

    def live_columns(self) -> int:
        """Columns the busiest row uses: its committed prefix plus its tree."""
        if not self.rows:
            return 0
        return int(max(int(c) + len(r.nodes) for c, r in zip(self.committed.sum(1).tolist(), self.rows)))

    @torch.inference_mode()
    def compact(self, keep_rows: list[int] | None = None, force: bool = False) -> None:
        """Drop rows not in `keep_rows` and, when dead columns outnumber live ones (or `force`), gather every
        row's committed and tree columns into a fresh, narrower cache (tree nodes are renumbered)."""
        keep_rows = list(range(len(self.rows))) if keep_rows is None else keep_rows
        live = self.live_columns()
        if not (force or self.committed.shape[1] - live > max(32, live)):
            if len(keep_rows) < len(self.rows):
                self._select_rows(keep_rows)
            return
        columns = []
        for r in keep_rows:
            committed_columns = self.committed[r].nonzero().flatten().tolist()
            columns.append(committed_columns + [node.column for node in self.rows[r].nodes])
        width = max((len(c) for c in columns), default=0)
        index = torch.zeros((len(keep_rows), width), dtype=torch.long)
        committed = torch.zeros((len(keep_rows), width), dtype=torch.bool)
        for i, (r, cols) in enumerate(zip(keep_rows, columns)):
            offset = width - len(cols)
            index[i, offset:] = torch.tensor(cols, dtype=torch.long)
            committed[i, offset : offset + len(cols) - len(self.rows[r].nodes)] = True
            renumber = {old: offset + new for new, old in enumerate(cols)}
            for node in self.rows[r].nodes:
                node.column = renumber[node.column]
                node.ancestor_columns = [renumber[c] for c in node.ancestor_columns]
        self._select_rows(keep_rows, [torch.tensor(cols, dtype=torch.long, device=self.device) for cols in columns])
        self.column_positions = self.column_positions.gather(1, index.to(self.device))
        self.committed = committed.to(self.device)

    def _select_rows(self, rows: list[int], columns: list[torch.Tensor] | None = None) -> None:
        """Keep the given rows, in that order (a row may repeat): cache, masks and per-row state. With `columns`,
        each kept row's cache keeps only those columns, right-aligned (compaction; the caller sets the masks)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for layer in self._layers():
            pieces = [(i, layer.keys[r:r + 1], layer.values[r:r + 1]) for i, r in enumerate(rows)]
            width = layer.keys.shape[2]
            if columns is not None:
                pieces = [(i, keys.index_select(2, c), values.index_select(2, c)) for (i, keys, values), c in zip(pieces, columns)]
                width = max((len(c) for c in columns), default=0)
            layer.place(len(rows), width, pieces)
        self.committed = self.committed.index_select(0, index)
        self.column_positions = self.column_positions.index_select(0, index)
        self.rows = [self.rows[r] for r in rows]
        self.root_logprobs = [self.root_logprobs[r] for r in rows]
        self.root_hidden = [self.root_hidden[r] for r in rows] if self.keep_hidden else []

    def reorder(self, rows: list[int]) -> None:
        """Put the rows (without trees) in this order."""
        self._select_rows(rows)

    def _layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    @torch.inference_mode()
    def repeat_rows(self, count: int) -> None:
        """Repeat each row `count` times in place (rows without trees), so parallel samples of one prompt share
        its prefill instead of encoding it `count` times."""
        self._select_rows([r for r in range(len(self.rows)) for _ in range(count)])
        self.rows = [Row(ids=list(row.ids), forwards=row.forwards) for row in self.rows]

    @torch.inference_mode()
    def extend(self, other: "TreeBatch") -> None:
        """Append the rows of `other` (same model) to this batch, so prompts can join a running batch as others
        finish. The narrower cache is left-padded with masked columns; tree nodes of shifted rows follow."""
        width = max(self.committed.shape[1], other.committed.shape[1])
        for batch in (self, other):
            _shift_nodes(batch.rows, width - batch.committed.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.place(len(self.rows) + len(other.rows), width,
                       [(0, mine.keys, mine.values), (len(self.rows), theirs.keys, theirs.values)])
        self.committed = torch.cat([_left_pad(self.committed, width, 1), _left_pad(other.committed, width, 1)])
        self.column_positions = torch.cat(
            [_left_pad(self.column_positions, width, 1), _left_pad(other.column_positions, width, 1)]
        )
        self.rows += other.rows
        self.root_logprobs += other.root_logprobs
        self.root_hidden += other.root_hidden


def _shift_nodes(rows: list[Row], offset: int) -> None:
    """Move tree nodes `offset` columns right, after their cache was left-padded by that much."""
    if offset:
        for row in rows:
            for node in row.nodes:
                node.column += offset
                node.ancestor_columns = [c + offset for c in node.ancestor_columns]


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero columns before `tensor` along `dim` up to `width` (zero means masked in the committed mask)."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
