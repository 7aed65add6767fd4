"""Iterators driven in a worker thread, so nothing the caller does between items holds up the producer.

A stream is driven in a worker thread and hands its events over a queue: a caller that stops reading (but keeps
the stream) lets the decode finish on its own, so other calls on the engine do not wait for the caller; a caller
that closes or drops the stream cancels the decode before its next event.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from contextlib import closing
from typing import Any, TypeVar

T = TypeVar("T")

DONE = object()
"""Handed over after the last item (and after the error, when the producer raised one)."""


def drive_in_thread(make_events: Callable[[], Generator], hand_over: Callable[[Any], None], stopped: threading.Event,
                    name: str) -> None:
    """In a worker thread, make the events and hand each one over, then the error if one is raised, then DONE;
    once `stopped` is set, close the events before the next one. Not a daemon: an exiting interpreter waits for the
    decode to stop (at its next event once stopped) rather than killing it inside a model call, which aborts."""

    def drive() -> None:
        try:
            with closing(make_events()) as events:
                for event in events:
                    if stopped.is_set():
                        break
                    hand_over(event)
        except BaseException as error:  # raised in the consumer's thread
            hand_over(error)
        hand_over(DONE)

    threading.Thread(target=drive, name=name).start()


def in_worker_thread(events: Generator[T, None, None]) -> Iterator[T]:
    """Yield what `events` yields, driving it in a worker thread; its errors are raised here."""
    handed: queue.SimpleQueue = queue.SimpleQueue()
    stopped = threading.Event()
    drive_in_thread(lambda: events, handed.put, stopped, "adafuse-stream")
    try:
        while (item := handed.get()) is not DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()


async def iterate_in_thread(make_iterator: Callable[[], Generator[T, None, None]]) -> AsyncIterator[T]:
    """Drive a blocking iterator in a worker thread so the event loop stays free; re-raise its errors.

    Closing or cancelling the async iterator stops the worker before its next item (and closes the blocking
    iterator, which cancels an engine stream), so an abandoned `astream` does not keep decoding.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stopped = threading.Event()

    def hand_over(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            stopped.set()

    drive_in_thread(make_iterator, hand_over, stopped, "adafuse-astream")
    try:
        while (item := await queue.get()) is not DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stopped.set()
