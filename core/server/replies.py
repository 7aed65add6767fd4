"""The fused model's results in the shapes OpenAI's API replies with: completion and chat bodies, stream chunks as
server-sent events, tool calls, usage."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..result import GenerationResult
from ..tools import ParsedReply

__all__ = ["DONE_EVENT", "Reply", "chat_finish", "completion_choice", "finish_reason", "info", "sse", "tool_calls", "usage"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class Reply:
    """What every part of one reply carries: its id, creation time and the served model's name."""

    prefix: str
    model: str
    id: str = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"

    def body(self, kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **({"usage": usage} if usage else {})}


def completion_choice(text: str, finish: str | None, index: int = 0) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": None}


def finish_reason(result: GenerationResult) -> str:
    return _FINISH[result.finish_reason]


def chat_finish(result: GenerationResult, reply: ParsedReply) -> str:
    return "tool_calls" if reply.tool_calls or reply.invalid_tool_calls else finish_reason(result)


def tool_calls(reply: ParsedReply) -> list[dict[str, Any]]:
    """OpenAI's tool_calls: arguments as a JSON string; a malformed call's raw text as its arguments."""
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
             for c in reply.tool_calls]
    calls += [{"id": c.id, "type": "function", "function": {"name": c.name or "", "arguments": c.text}}
              for c in reply.invalid_tool_calls]
    return calls


def usage(first_member: str, results: Sequence[GenerationResult]) -> dict[str, int]:
    """Tokens in the first member's tokenizer, as the budget is counted."""
    prompt = sum(r.stats.prompt_tokens.get(first_member, 0) for r in results)
    completion = sum(r.stats.new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def info(result: GenerationResult) -> dict[str, Any]:
    """The fused decode's own figures, in the reply's `adafuse` field."""
    stats = result.stats
    return {"finish_reason": result.finish_reason, "rounds": stats.rounds, "batch_size": stats.batch_size,
            "forward_passes": stats.forward_passes}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
