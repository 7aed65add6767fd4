"""The fused model behind an OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE
streaming, tools, response_format), /v1/models, /health.

Every request goes through the engine's request batcher, so concurrent clients decode in one continuous batch;
at most `max_pending` requests are in flight (more get 429); a client that disconnects leaves the batch at the
next step. Bad input is a 400 or 422 naming the field, in OpenAI's error shape.
"""
from __future__ import annotations

import asyncio
import logging
import re
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import Chat
from ..config import DECODING_PARAMETERS
from ..result import GenerationResult
from ..streaming import iterate_in_thread
from ..tools import ReplyStream
from . import replies
from .replies import Reply
from .schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

Events = AsyncIterator[str | GenerationResult]
Release = Callable[[], None]
Body = CompletionRequest | ChatCompletionRequest


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Slots:
    """Requests in flight, at most `limit`; each taken slot is released once (by its response's end, or by the
    garbage collector where a client left before its stream began)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self) -> Release:
        if self.used >= self.limit:
            raise _Refused(429, f"server busy: {self.used} requests in flight (at most {self.limit})", None,
                           "rate_limit_error")
        self.used += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released, self.used = True, self.used - 1

        return release


def create_app(engine: Any, *, model_name: str | None = None, max_pending: int = 64, max_tokens: int = 256) -> FastAPI:
    """The app serving `engine` (an `AdaFuse`) as model `model_name` (default "adafuse(a+b)"); `max_tokens` is the
    chat reply budget when a request sets none."""
    endpoints = _Endpoints(engine, model_name or "adafuse(" + "+".join(engine.model_names) + ")", max_pending, max_tokens)
    app = FastAPI(title="adafuse", summary=f"OpenAI-compatible server for {endpoints.served}")
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(_Refused, _refused)
    app.get("/health")(_health)
    app.get("/v1/models")(endpoints.models)
    app.post("/v1/completions")(endpoints.completions)
    app.post("/v1/chat/completions")(endpoints.chat_completions)
    return app


class _Endpoints:
    """The request handlers over one engine: each admits a request, starts it in the batcher, and shapes the
    result as OpenAI does."""

    def __init__(self, engine: Any, served: str, max_pending: int, max_tokens: int):
        self.engine, self.served, self.slots, self.max_tokens = engine, served, _Slots(max_pending), max_tokens

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.served, "object": "model", "created": 0, "owned_by": "adafuse",
                                            "members": self.engine.model_names}]}

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if body.stream and len(prompts) > 1:
            raise _Refused(400, "stream with several prompts is not supported; send one per request", "prompt")
        release, streams = await self._begin(body, prompts, _options(body, body.max_tokens))
        reply = Reply("cmpl", self.served)
        if body.stream:
            return _streaming(self._completion_events(streams[0], reply, _wants_usage(body), release), release)
        results = await _results(streams, request, release)
        if results is None:
            return _client_gone()
        choices = [replies.completion_choice(r.text, replies.finish_reason(r), i) for i, r in enumerate(results)]
        return {**reply.body("text_completion", choices, self._usage(results)), "adafuse": [replies.info(r) for r in results]}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        try:
            chat = Chat.with_tools(body.messages, body.tools, body.tool_choice)
            json_schema = body.json_schema()
        except (ValueError, TypeError) as error:
            raise _Refused(400, str(error)) from None
        options = _options(body, body.max_completion_tokens or body.max_tokens or self.max_tokens)
        if json_schema is not None:
            options["json_schema"] = json_schema
        release, [events] = await self._begin(body, [chat], options)
        reply, replying = Reply("chatcmpl", self.served), chat.reply_stream()
        if body.stream:
            return _streaming(self._chat_events(events, replying, reply, _wants_usage(body), release), release)
        results = await _results([events], request, release)
        if results is None:
            return _client_gone()
        replying.feed(results[0].text)
        parsed = replying.parsed()
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if calls := replies.tool_calls(parsed):
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "finish_reason": replies.chat_finish(results[0], parsed), "logprobs": None}
        return {**reply.body("chat.completion", [choice], self._usage(results)), "adafuse": replies.info(results[0])}

    async def _begin(self, body: Body, prompts: list[Any], options: dict[str, Any]) -> tuple[Release, list[Events]]:
        """A slot and each prompt's events, the first of each already awaited, so bad input is refused (400) before
        any response begins; on a refusal, what was started is stopped and the slot given back."""
        if body.model is not None and body.model != self.served:
            raise _Refused(404, f"model {body.model!r} is not served here; this server serves {self.served!r}", "model")
        release, started = self.slots.take(), []
        try:
            for prompt in prompts:
                events = iterate_in_thread(lambda prompt=prompt: self.engine.batcher.stream(prompt, **options))
                started.append(events)
                try:
                    first = await anext(events)
                except (ValueError, TypeError) as error:
                    raise _Refused(400, str(error), _named_field(error)) from None
                started[-1] = _prepend(first, events)
        except BaseException:
            for events in started:
                await events.aclose()
            release()
            raise
        return release, started

    async def _completion_events(self, events: Events, reply: Reply, with_usage: bool, release: Release) -> AsyncIterator[str]:
        try:
            async for event in events:
                if isinstance(event, GenerationResult):
                    yield replies.sse(reply.body("text_completion", [replies.completion_choice("", replies.finish_reason(event))]))
                    if with_usage:
                        yield replies.sse(reply.body("text_completion", [], self._usage([event])))
                else:
                    yield replies.sse(reply.body("text_completion", [replies.completion_choice(event, None)]))
            yield replies.DONE_EVENT
        finally:
            await events.aclose()
            release()

    async def _chat_events(self, events: Events, replying: ReplyStream, reply: Reply, with_usage: bool,
                           release: Release) -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return replies.sse(reply.body("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish}]))

        try:
            yield chunk({"role": "assistant", "content": ""})
            async for event in events:
                if isinstance(event, GenerationResult):
                    rest, parsed = replying.finish()
                    delta: dict[str, Any] = {"content": rest} if rest else {}
                    if calls := replies.tool_calls(parsed):
                        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                    yield chunk(delta, replies.chat_finish(event, parsed))
                    if with_usage:
                        yield replies.sse(reply.body("chat.completion.chunk", [], self._usage([event])))
                elif piece := replying.feed(event):
                    yield chunk({"content": piece})
            yield replies.DONE_EVENT
        finally:
            await events.aclose()
            release()

    def _usage(self, results: list[GenerationResult]) -> dict[str, int]:
        return replies.usage(self.engine.model_names[0], results)


def _client_gone() -> JSONResponse:
    return JSONResponse({}, status_code=499)  # nobody reads it: the client has disconnected


async def _health() -> dict[str, str]:
    return {"status": "ok"}


async def _invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        return _error(422, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if tuple(first["loc"]) == ("body",):
        return _error(422, "the body must be a JSON object, sent with Content-Type: application/json")
    param = ".".join(str(part) for part in first["loc"] if part != "body")
    return _error(422, f"{param}: {first['msg']}", param)


async def _refused(_: Request, error: _Refused) -> JSONResponse:
    return _error(error.status, error.message, error.param, error.kind)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def _streaming(body: AsyncIterator[str], release: Release) -> StreamingResponse:
    weakref.finalize(body, release)
    return StreamingResponse(body, media_type="text/event-stream")


def _wants_usage(body: Body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _named_field(error: Exception) -> str | None:
    """The decoding field a configuration error names ("invalid tau_delta=3: ..." names tau_delta)."""
    match = re.match(r"invalid (\w+)=", str(error))
    return match.group(1) if match else None


def _options(body: Body, budget: int | None) -> dict[str, Any]:
    """The engine overrides of a request: its budget, stops and seed, and any FusionConfig fields it sent."""
    extras = body.extras()
    ignored = sorted(set(extras) - DECODING_PARAMETERS)
    if ignored:
        logger.debug("ignoring request fields %s", ignored)
    options = {k: v for k, v in extras.items() if k in DECODING_PARAMETERS}
    if budget is not None:
        options["max_new_tokens"] = budget
    if body.stop is not None:
        options["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.seed is not None:
        options["seed"] = body.seed
    return options


async def _prepend(first: str | GenerationResult, rest: Events) -> Events:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()


async def _results(streams: list[Events], request: Request, release: Release) -> list[GenerationResult] | None:
    """Each stream's result, the slot given back after; None (and the requests dropped from the batch) once the
    client has disconnected."""
    try:
        results = await asyncio.gather(*(_collect(s, request) for s in streams))
    finally:
        release()
    return None if any(r is None for r in results) else list(results)


async def _collect(events: Events, request: Request) -> GenerationResult | None:
    """The request's result; None (and the request dropped from the batch) once its client has disconnected."""
    try:
        async for event in events:
            if isinstance(event, GenerationResult):
                return event
            if await request.is_disconnected():
                return None
        raise RuntimeError("the batch ended without a result")
    finally:
        await events.aclose()
