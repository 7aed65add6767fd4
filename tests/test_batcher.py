"""The request batcher: concurrent callers share one continuous batch and get what each prompt gets alone."""
import asyncio
import threading
import time

import pytest

from adafuse.runtime.scheduler import Scheduler

PROMPTS = ["The quick brown fox", "Question: who wrote the play Hamlet?\nAnswer:", "In 1969 the first humans",
           "Paris is", "Once upon a time", "Adaptive ensemble decoding"]


def _budget(i: int) -> int:
    return 6 + 3 * (i % 3)


def _concurrently(batcher, engine_lock, calls):
    """Run `calls` in threads that all reach the batcher while it waits for the engine, so they share a batch."""
    results = [None] * len(calls)

    def run(i):
        results[i] = calls[i]()

    with engine_lock:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 10
        while batcher._incoming.qsize() < len(calls) - 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the worker holds the first request and waits for the lock; the rest are queued
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_concurrent_requests_share_a_batch_and_decode_as_alone(pair):
    alone = [pair.generate(p, max_new_tokens=_budget(i)) for i, p in enumerate(PROMPTS)]
    batcher = pair.batcher
    together = _concurrently(batcher, pair._lock, [
        (lambda i=i: batcher.generate(PROMPTS[i], max_new_tokens=_budget(i))) for i in range(len(PROMPTS))])
    assert [r.text for r in together] == [r.text for r in alone]
    assert [r.finish_reason for r in together] == [r.finish_reason for r in alone]
    assert max(r.stats.batch_size for r in together) == len(PROMPTS)


def test_requests_with_different_settings_share_a_batch(pair):
    settings = [{"tau_delta": 1.0, "num_branches": 1}, {"stop": [" "]}, {"regex": "(yes|no)"}, {"scoring": "mean"}]
    alone = [pair.generate(PROMPTS[0], max_new_tokens=8, **s).text for s in settings]
    batcher = pair.batcher
    together = _concurrently(batcher, pair._lock, [
        (lambda s=s: batcher.generate(PROMPTS[0], max_new_tokens=8, **s)) for s in settings])
    assert [r.text for r in together] == alone


def test_an_abandoned_stream_leaves_the_batch(pair):
    stream = pair.batcher.stream(PROMPTS[0], max_new_tokens=200)
    next(stream)
    stream.close()
    short = pair.batcher.generate(PROMPTS[3], max_new_tokens=3)
    assert short.stats.batch_size == 1 and short.text == pair.generate(PROMPTS[3], max_new_tokens=3).text


def test_bad_input_raises_in_the_caller_and_a_failed_batch_leaves_the_batcher_usable(pair, monkeypatch):
    with pytest.raises(ValueError, match="prompt is empty"):
        pair.batcher.generate("  ")
    feed = Scheduler._feed
    calls = {"n": 0}

    def failing_once(self, needs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("model went away")
        return feed(self, needs)

    monkeypatch.setattr(Scheduler, "_feed", failing_once)
    with pytest.raises(RuntimeError, match="model went away"):
        pair.batcher.generate(PROMPTS[0], max_new_tokens=8)
    assert pair.batcher.generate(PROMPTS[0], max_new_tokens=8).text == pair.generate(PROMPTS[0], max_new_tokens=8).text


def test_concurrent_async_chat_calls_join_one_batch(long_pair):
    pytest.importorskip("langchain_core")
    from adafuse_integrations.langchain import AdaFuseLLM, ChatAdaFuse

    chat = ChatAdaFuse(engine=long_pair, max_new_tokens=8)
    questions = ["What is the weather in Paris?", "Who wrote Hamlet?", "Name a river."]

    async def run():
        return await asyncio.gather(*(chat.ainvoke(q) for q in questions))

    replies = asyncio.run(run())
    assert [r.content for r in replies] == [chat.invoke(q).content for q in questions]
    llm = AdaFuseLLM(engine=long_pair, max_new_tokens=8)
    assert llm.batch(PROMPTS[:3], max_batch_size=2) == [long_pair.generate(p, max_new_tokens=8).text for p in PROMPTS[:3]]


def test_the_worker_ends_when_idle_and_an_exiting_interpreter_waits_for_it(pair):
    """A daemon worker killed at exit while freeing a batch's tensors aborts the process ('terminate called without
    an active exception'); the worker is not a daemon and lives only while requests are in flight."""
    first = pair.batcher.generate(PROMPTS[0], max_new_tokens=4)
    workers = [t for t in threading.enumerate() if t.name == "adafuse-batcher"]
    assert all(not t.daemon for t in workers)
    for worker in workers:
        worker.join(timeout=30)
    assert not any(t.name == "adafuse-batcher" for t in threading.enumerate())
    assert pair.batcher.generate(PROMPTS[0], max_new_tokens=4).text == first.text  # a new worker starts on demand
