"""Streams that never hold the engine's lock while the caller is away.

A stream is driven in a worker thread and hands its events over a queue: a caller that stops reading (but keeps
the stream) lets the decode finish on its own, so other calls on the engine do not wait for the caller; a caller
that closes or drops the stream cancels the decode before its next event.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator
from typing import TypeVar

T = TypeVar("T")

_DONE = object()


def in_worker_thread(events: Generator[T, None, None]) -> Iterator[T]:
    """Yield what `events` yields, driving it in a daemon thread; its errors are raised here."""
    handed: queue.SimpleQueue = queue.SimpleQueue()
    cancelled = threading.Event()

    def drive() -> None:
        try:
            for event in events:
                if cancelled.is_set():
                    break
                handed.put(event)
        except BaseException as error:  # raised in the caller's thread
            handed.put(error)
        finally:
            events.close()
            handed.put(_DONE)

    threading.Thread(target=drive, name="adafuse-stream", daemon=True).start()
    try:
        while (item := handed.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()
