"""Concurrent requests in one continuous batch: calls from any thread (or event loop, through a worker thread) join
the rows already decoding instead of waiting for them, as in an inference server.

One worker thread owns the engine while requests are in flight. Each request keeps its own configuration, so
requests with different budgets, stops or constraints share a batch; a request whose reader goes away is dropped
at the next step, so an abandoned stream frees its slot.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import FusionConfig
from ..prompts import Prompt, normalize_prompt
from ..result import GenerationResult
from ..runtime import TokenTree
from ..runtime.scheduler import RowTask, Scheduler
from ..streaming import DONE
from .constrained import row_constraint
from .round import RoundContext
from .state import RowState

__all__ = ["RequestBatcher"]

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: Prompt
    config: FusionConfig
    encoded: list[list[int]]  # per model
    state: RowState
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    abandoned: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)


class RequestBatcher:
    """Decodes the requests of many callers together, at most `max_batch_size` at a time.

    `stream(prompt, **overrides)` and `generate(...)` behave as the engine's, and give the same answers as the
    prompt decoded alone. Learned samplers, fusion gates and whole-answer reranking are decoded by the engine directly
    (after the running batch), since they are not row-by-row decodings.
    """

    def __init__(self, engine: Any, max_batch_size: int = 8):  # the AdaFuse engine (which imports this module)
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.engine, self.max_batch_size = engine, max_batch_size
        self._incoming: queue.SimpleQueue[_Request] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._worker: threading.Thread | None = None

    def generate(self, prompt: Prompt, **overrides: Any) -> GenerationResult:
        for event in self.stream(prompt, **overrides):
            if isinstance(event, GenerationResult):
                return event
        raise RuntimeError("the batch ended without a result")  # the worker always sends one; guards a logic error

    def stream(self, prompt: Prompt, *, trace: bool = False, **overrides: Any) -> Iterator[str | GenerationResult]:
        """Text pieces as rounds commit them, then the `GenerationResult`. Bad input raises here, before decoding;
        closing the iterator drops the request from the batch."""
        prompt, config = normalize_prompt(prompt), self.engine._call_config(overrides)
        if not config.decodes_row_by_row:
            yield from self.engine.stream(prompt, trace=trace, **overrides)
            return
        encoded = [ids[0] for ids in self.engine._encode([prompt], config)]
        request = _Request(prompt, config, encoded, RowState(trace=[] if trace else None, constraint=row_constraint(prompt, config)))
        self._incoming.put(request)
        self._ensure_worker()
        try:
            while (item := request.events.get()) is not DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            request.abandoned.set()

    # ------------------------------------------------------------------ the worker
    def _ensure_worker(self) -> None:
        with self._start_lock:
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._serve, name="adafuse-batcher")
                self._worker.start()

    def _serve(self) -> None:
        """Decode until no request is left, then end. The worker lives only while requests are in flight and is not
        a daemon, so an exiting interpreter waits for it to free the batch's tensors instead of killing it midway
        (which aborts the process)."""
        while True:
            with self._start_lock:
                try:
                    first = self._incoming.get_nowait()
                except queue.Empty:
                    self._worker = None
                    return
            with self.engine._lock:
                self._busy_period(first)

    def _busy_period(self, first: _Request) -> None:
        engine = self.engine
        requests: dict[int, _Request] = {}
        scheduler = Scheduler(0, self.max_batch_size)

        def arrivals() -> list[int]:
            new = [first] if not requests else []
            while True:
                try:
                    new.append(self._incoming.get_nowait())
                except queue.Empty:
                    break
            for request in new:
                requests[len(requests)] = request
            return list(range(len(requests) - len(new), len(requests)))

        def admit(joining: list[int]) -> list[TokenTree]:
            return engine._admit(joining, {r: requests[r].prompt for r in joining},
                                 [{r: requests[r].encoded[m] for r in joining} for m in range(len(engine.backends))],
                                 {r: requests[r].state for r in joining}, {r: requests[r].config for r in joining},
                                 keep_hidden=False)

        def start(r: int) -> RowTask:
            request = requests[r]
            request.state.stats.prompt_tokens = {b.name: len(ids) for b, ids in zip(engine.backends, request.encoded)}
            generator = torch.Generator(device=engine.backends[0].device).manual_seed(request.config.seed)
            context = RoundContext(engine.backends, scheduler, request.config, None, generator)
            return self._row(r, request, engine._start_row(r, request.state, context), scheduler)

        try:
            for r in scheduler.run(admit, start, arrivals):
                for piece in requests[r].state.take_pieces():
                    requests[r].events.put(piece)
        except BaseException as error:  # a model failed: every request in flight gets the error, the worker goes on
            logger.exception("request batch failed")
            for request in requests.values():
                if not request.abandoned.is_set():
                    request.events.put(error)
                    request.events.put(DONE)

    def _row(self, r: int, request: _Request, task: RowTask, scheduler: Scheduler) -> RowTask:
        """The row's rounds, ended early when its reader is gone; on its end, the result to the reader."""
        fed = None
        while not request.abandoned.is_set():
            try:
                needs = task.send(fed)
            except StopIteration:
                break
            fed = yield needs
        else:
            task.close()
            request.state.finish_reason = request.state.finish_reason or "cancelled"
        state, position = request.state, scheduler.position(r)
        state.stats.new_tokens = state.new_tokens
        state.stats.batch_size = len(scheduler.active)
        state.stats.wall_time_s = time.perf_counter() - request.submitted
        forwards = {b.name: batch.rows[position].forwards for b, batch in zip(self.engine.backends, scheduler.batches)}
        state.stats.row_forward_passes = state.stats.forward_passes = forwards
        for piece in state.take_pieces():
            request.events.put(piece)
        if state.emitted < len(state.text):
            request.events.put(state.text[state.emitted:])
        request.events.put(GenerationResult(state.text, state.finish_reason, state.stats, state.trace))
        request.events.put(DONE)
