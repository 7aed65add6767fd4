"""The fused model behind an OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE
streaming, tools, response_format), /v1/models, /health.

Every request goes through the engine's request batcher, so concurrent clients decode in one continuous batch;
at most `max_pending` requests are in flight (more get 429); a client that disconnects leaves the batch at the
next step. Bad input is a 400 or 422 naming the field, in OpenAI's error shape.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..chat import Chat
from ..config import FusionConfig
from ..result import GenerationResult
from ..streaming import iterate_in_thread
from ..tools import ParsedReply
from .schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_DECODING_FIELDS = frozenset(f.name for f in dataclasses.fields(FusionConfig))
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
Events = AsyncIterator[str | GenerationResult]


class _Refused(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class _Slots:
    """Requests in flight, at most `limit`; each taken slot is released once (by its response's end, or by the
    garbage collector where a client left before its stream began)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def take(self) -> Callable[[], None]:
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


def _streaming(body: AsyncIterator[str], release: Callable[[], None]) -> StreamingResponse:
    weakref.finalize(body, release)
    return StreamingResponse(body, media_type="text/event-stream")


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


def create_app(engine: Any, *, model_name: str | None = None, max_pending: int = 64, max_tokens: int = 256) -> FastAPI:
    """The app serving `engine` (an `AdaFuse`) as model `model_name` (default "adafuse(a+b)"); `max_tokens` is the
    chat reply budget when a request sets none."""
    served = model_name or "adafuse(" + "+".join(engine.model_names) + ")"
    app = FastAPI(title="adafuse", summary=f"OpenAI-compatible server for {served}")
    slots = _Slots(max_pending)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            return _error(422, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        if tuple(first["loc"]) == ("body",):
            return _error(422, "the body must be a JSON object, sent with Content-Type: application/json")
        param = ".".join(str(part) for part in first["loc"] if part != "body")
        return _error(422, f"{param}: {first['msg']}", param)

    @app.exception_handler(_Refused)
    async def refused(_: Request, error: _Refused) -> JSONResponse:
        return _error(error.status, error.message, error.param, error.kind)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0, "owned_by": "adafuse",
                                            "members": engine.model_names}]}

    def admit(body: CompletionRequest | ChatCompletionRequest) -> Callable[[], None]:
        if body.model is not None and body.model != served:
            raise _Refused(404, f"model {body.model!r} is not served here; this server serves {served!r}", "model")
        return slots.take()

    async def start(prompt: Any, options: dict[str, Any]) -> Events:
        """The request's events, its first one already awaited, so bad input is refused before any response."""
        events = iterate_in_thread(lambda: engine.batcher.stream(prompt, **options))
        try:
            first = await anext(events)
        except (ValueError, TypeError) as error:
            await events.aclose()
            raise _Refused(400, str(error), _named_field(error)) from None
        return _prepend(first, events)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        release = admit(body)
        try:
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if body.stream and len(prompts) > 1:
                raise _Refused(400, "stream with several prompts is not supported; send one per request", "prompt")
            options = _options(body, body.max_tokens)
            streams = [await start(p, options) for p in prompts]
        except BaseException:
            release()
            raise
        reply_id, created = "cmpl-" + uuid.uuid4().hex, int(time.time())

        def envelope(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            return {"id": reply_id, "object": "text_completion", "created": created, "model": served,
                    "choices": choices, **({"usage": usage} if usage else {})}

        if body.stream:
            async def sse() -> AsyncIterator[str]:
                try:
                    async for event in streams[0]:
                        if isinstance(event, GenerationResult):
                            yield _sse(envelope([{"index": 0, "text": "", "finish_reason": _FINISH[event.finish_reason],
                                                  "logprobs": None}]))
                            if body.stream_options and body.stream_options.include_usage:
                                yield _sse(envelope([], _usage(engine, [event])))
                        else:
                            yield _sse(envelope([{"index": 0, "text": event, "finish_reason": None, "logprobs": None}]))
                    yield "data: [DONE]\n\n"
                finally:
                    await streams[0].aclose()
                    release()
            return _streaming(sse(), release)
        try:
            results = await asyncio.gather(*(_collect(s, request) for s in streams))
        finally:
            release()
        if any(r is None for r in results):
            return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
        choices = [{"index": i, "text": r.text, "finish_reason": _FINISH[r.finish_reason], "logprobs": None}
                   for i, r in enumerate(results)]
        return {**envelope(choices, _usage(engine, results)), "adafuse": [_info(r) for r in results]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        release = admit(body)
        try:
            try:
                chat = Chat.with_tools(body.messages, body.tools, body.tool_choice)
                json_schema = body.json_schema()
            except (ValueError, TypeError) as error:
                raise _Refused(400, str(error)) from None
            options = _options(body, body.max_completion_tokens or body.max_tokens or max_tokens)
            if json_schema is not None:
                options["json_schema"] = json_schema
            events = await start(chat, options)
        except BaseException:
            release()
            raise
        reply_id, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        replying = chat.reply_stream()

        def envelope(kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            return {"id": reply_id, "object": kind, "created": created, "model": served, "choices": choices,
                    **({"usage": usage} if usage else {})}

        if body.stream:
            async def sse() -> AsyncIterator[str]:
                try:
                    yield _sse(envelope("chat.completion.chunk", [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                                   "finish_reason": None}]))
                    async for event in events:
                        if isinstance(event, GenerationResult):
                            rest, reply = replying.finish()
                            delta: dict[str, Any] = {"content": rest} if rest else {}
                            if calls := _tool_calls(reply):
                                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                            yield _sse(envelope("chat.completion.chunk", [{"index": 0, "delta": delta,
                                                                           "finish_reason": _chat_finish(event, reply)}]))
                            if body.stream_options and body.stream_options.include_usage:
                                yield _sse(envelope("chat.completion.chunk", [], _usage(engine, [event])))
                        elif piece := replying.feed(event):
                            yield _sse(envelope("chat.completion.chunk", [{"index": 0, "delta": {"content": piece},
                                                                           "finish_reason": None}]))
                    yield "data: [DONE]\n\n"
                finally:
                    await events.aclose()
                    release()
            return _streaming(sse(), release)
        try:
            result = await _collect(events, request)
        finally:
            release()
        if result is None:
            return JSONResponse({}, status_code=499)
        replying.feed(result.text)
        reply = replying.parsed()
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if calls := _tool_calls(reply):
            message["tool_calls"] = calls
        choice = {"index": 0, "message": message, "finish_reason": _chat_finish(result, reply), "logprobs": None}
        return {**envelope("chat.completion", [choice], _usage(engine, [result])), "adafuse": _info(result)}

    return app


def _named_field(error: Exception) -> str | None:
    """The decoding field a configuration error names ("invalid tau_delta=3: ..." names tau_delta)."""
    match = re.match(r"invalid (\w+)=", str(error))
    return match.group(1) if match else None


def _options(body: CompletionRequest | ChatCompletionRequest, budget: int | None) -> dict[str, Any]:
    """The engine overrides of a request: its budget, stops and seed, and any FusionConfig fields it sent."""
    extras = body.extras()
    ignored = sorted(set(extras) - _DECODING_FIELDS)
    if ignored:
        logger.debug("ignoring request fields %s", ignored)
    options = {k: v for k, v in extras.items() if k in _DECODING_FIELDS}
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


def _tool_calls(reply: ParsedReply) -> list[dict[str, Any]]:
    """OpenAI's tool_calls: arguments as a JSON string; a malformed call's raw text as its arguments."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in reply.tool_calls]
    calls += [{"id": c.id, "type": "function", "function": {"name": c.name or "", "arguments": c.text}}
              for c in reply.invalid_tool_calls]
    return calls


def _chat_finish(result: GenerationResult, reply: ParsedReply) -> str:
    return "tool_calls" if reply.tool_calls or reply.invalid_tool_calls else _FINISH[result.finish_reason]


def _usage(engine: Any, results: list[GenerationResult]) -> dict[str, int]:
    """Tokens in the first member's tokenizer, as the budget is counted."""
    first = engine.model_names[0]
    prompt = sum(r.stats.prompt_tokens.get(first, 0) for r in results)
    completion = sum(r.stats.new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _info(result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {"finish_reason": result.finish_reason, "rounds": stats.rounds, "batch_size": stats.batch_size,
            "forward_passes": stats.forward_passes}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
