"""Continuous batching: rows run as coroutines over one `TreeBatch` per model, one forward per model per step.

Each row's coroutine yields the scratch tokens it needs next, per model, and is sent back the node ids they got;
whatever phase of its own round each row is in, one forward per model serves all of them, so rows never wait for
each other's rounds. Waiting rows join as others finish.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterator

from .tree_batch import TreeBatch

__all__ = ["Fed", "JOIN_AT", "Needs", "RowTask", "Scheduler"]

# Waiting prompts join a running batch once this share of its slots is free, or as soon as all of them fit: each
# join costs a prefill forward and a cache copy, so joining in groups beats joining one by one, but the last group
# has nobody to wait for (benchmarks/bench_decoding.py).
JOIN_AT = 0.5

Needs = dict[int, list[tuple[int, int]]]  # per model index: the (token, parent node) requests of one row
Fed = dict[int, list[int]]  # per model index: the node ids those requests got
RowTask = Generator[Needs, "Fed | None", None]


class Scheduler:
    """Which rows are running (`active`, in batch order) and waiting, over the models' batches (`batches`)."""

    def __init__(self, rows: int, capacity: int | None = None, join_at: float = JOIN_AT):
        self.batches: list[TreeBatch] = []
        self.active: list[int] = []
        self.waiting = deque(range(rows))
        self.capacity = capacity or rows
        self.join_at = join_at
        self.row_forwards: dict[int, list[int]] = {}  # per finished row, per model: forward passes it took part in

    def position(self, row: int) -> int:
        """Where a running row sits in every batch."""
        return self.active.index(row)

    def run(self, admit: Callable[[list[int]], list[TreeBatch]], start: Callable[[int], RowTask],
            arrivals: Callable[[], list[int]] | None = None) -> Iterator[int]:
        """Drive every row to its end. `admit(rows)` prefills joining rows (one new batch per model); `start(row)`
        makes a joined row's coroutine; `arrivals()`, called before every step, returns rows that arrived since
        (a request batcher's). Yields each row index after its coroutine advanced, so the caller can hand out what
        the row produced."""
        tasks: dict[int, RowTask] = {}
        needs: dict[int, Needs] = {}
        fed: dict[int, Fed] = {}
        while True:
            if arrivals is not None:
                self.waiting.extend(arrivals())
            if not (self.active or self.waiting):
                return
            joining = self._joining()
            if joining:
                self.join(admit(joining))
                self.active += joining
                for r in joining:
                    tasks[r] = start(r)
            finished = []
            for r in self.active:
                try:
                    needs[r] = tasks[r].send(fed.get(r))
                except StopIteration:
                    finished.append(r)
                yield r
            self._retire(finished)
            fed = self._feed(needs)

    def _joining(self) -> list[int]:
        free = self.capacity - len(self.active)
        if not self.waiting or free <= 0 or free < min(len(self.waiting), self.join_at * self.capacity):
            return []
        return [self.waiting.popleft() for _ in range(min(len(self.waiting), free))]

    def join(self, new: list[TreeBatch]) -> None:
        """Add freshly prefilled rows (one batch per model) to the running batches."""
        if not self.batches:
            self.batches.extend(new)
            return
        for batch, joining in zip(self.batches, new):
            batch.extend(joining)

    def _retire(self, finished: list[int]) -> None:
        """Drop finished rows from every batch (keeping the forward passes each took part in) and reclaim dead
        cache columns when they pile up."""
        keep = [position for position, r in enumerate(self.active) if r not in finished]
        for r in finished:
            self.row_forwards[r] = [batch.rows[self.position(r)].forwards for batch in self.batches]
        for batch in self.batches:
            batch.compact(keep)
        self.active[:] = [r for r in self.active if r not in finished]

    def _feed(self, needs: dict[int, Needs]) -> dict[int, Fed]:
        """One forward per model over what every running row asked of it."""
        fed: dict[int, Fed] = {r: {} for r in self.active}
        for m, batch in enumerate(self.batches):
            requests = [needs[r].get(m, []) for r in self.active]
            if any(requests):
                for r, request, nodes in zip(self.active, requests, batch.feed(requests)):
                    if request:
                        fed[r][m] = nodes
        return fed
