"""Tool calling in text: how tools are described to a model whose chat template has no tool support, and how the
calls in a generated answer are read back.

The format is the Hermes/Qwen one, which many small instruct models have seen in training: the tool schemas as
JSON lines inside `<tools></tools>` in the system message, and each call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in the answer.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .constraints import schema_regex

logger = logging.getLogger(__name__)

__all__ = ["CALL_OPEN", "CALL_CLOSE", "ToolCall", "InvalidToolCall", "ParsedReply", "ReplyStream", "ToolChoice",
           "tool_instructions", "forced_call_prefix", "forced_call_pattern", "parse_tool_calls", "check_tools"]

ToolChoice = dict | str | bool | None
"""As OpenAI's: "auto" or None, "none", "required"/"any"/True (a call is required), a tool name or
{"type": "function", "function": {"name": ...}} (a call of that tool)."""

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class InvalidToolCall:
    """A `<tool_call>` block that is not a JSON object with a name and object arguments: kept, with why."""

    text: str
    error: str
    name: str | None = None
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


@dataclass
class ParsedReply:
    content: str
    tool_calls: list[ToolCall]
    invalid_tool_calls: list[InvalidToolCall]


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """`tools` as OpenAI function tools ({'type': 'function', 'function': {'name', 'parameters', ...}})."""
    if not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of OpenAI-style tool dicts, not {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tool {i} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}")
    return list(tools)


def tool_instructions(tools: list[dict[str, Any]]) -> str:
    """The system-message text that describes `tools` and how to call them."""
    schemas = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def forced_call_prefix(tools: list[dict[str, Any]], choice: ToolChoice) -> str:
    """The start the reply is given so that it is a tool call where `choice` requires one ("" where it does not):
    of the named tool, or of the only one offered."""
    names = _forced_names(tools, choice)
    if not names:
        return ""
    opening = f"{CALL_OPEN}\n" + '{"name": "'
    return opening + f'{names[0]}", "arguments": ' if len(names) == 1 else opening


def forced_call_pattern(tools: list[dict[str, Any]], choice: ToolChoice) -> str | None:
    """The regex the rest of a forced call must match (after `forced_call_prefix`): a tool's name where several may
    be called, its arguments as its parameters schema allows, and the call's closing. None where no call is forced,
    or a schema is beyond the regex translation (the call is then forced but its arguments are not)."""
    names = _forced_names(tools, choice)
    if not names:
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}} for t in tools}
    try:
        arguments = {name: schema_regex(schemas[name]) for name in names}
    except ValueError as error:
        logger.warning("tool call arguments are not constrained: %s", error)
        return None
    closing = r"[ ]?\}\n" + re.escape(CALL_CLOSE)
    if len(names) == 1:
        return arguments[names[0]] + closing
    calls = "|".join(f'{re.escape(name)}", "arguments": (?:{arguments[name]})' for name in names)
    return f"(?:{calls}){closing}"


def _forced_names(tools: list[dict[str, Any]], choice: ToolChoice) -> list[str]:
    """The tools one of which the reply must call; none when `choice` does not require a call."""
    if choice in (None, "auto", "none", False):
        return []
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        choice = choice.get("function", choice).get("name")
    if isinstance(choice, str) and choice not in ("any", "required"):
        if choice not in names:
            raise ValueError(f"tool_choice names {choice!r}, which is not among the tools {names}")
        return [choice]
    if choice not in ("any", "required", True):
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required', 'any' or a tool name, got {choice!r}")
    return names


def format_call(name: str, arguments: Any) -> str:
    """One call as the model writes it; arguments given as text (a malformed call from earlier) go in verbatim."""
    written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {written}}}\n{CALL_CLOSE}'


def parse_tool_calls(text: str) -> ParsedReply:
    """The text outside `<tool_call>` blocks (trailing whitespace and stray closing tags dropped), and each block as
    a valid or an invalid call. A block the answer ended in before closing it (the token budget ran out) is still read."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        try:
            value = json.loads(body)
        except json.JSONDecodeError as error:
            invalid.append(InvalidToolCall(body, f"not valid JSON: {error}", _name_in(body)))
            continue
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            invalid.append(InvalidToolCall(body, "a tool call must be a JSON object with a string 'name'"))
            continue
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            invalid.append(InvalidToolCall(body, "'arguments' must be a JSON object", value["name"]))
            continue
        calls.append(ToolCall(value["name"], arguments))
    if not (calls or invalid):
        return ParsedReply(text, calls, invalid)
    first = text.find(CALL_OPEN)  # stray closing tags after the calls began are call syntax too, not content
    content = text[:first] + _CALL.sub("", text[first:]).replace(CALL_CLOSE, "")
    return ParsedReply(content.rstrip(), calls, invalid)


def _name_in(body: str) -> str | None:
    found = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    return found.group(1) if found else None


class ReplyStream:
    """A reply arriving piece by piece, split into content that is safe to show now and, at the end, the tool
    calls: with tools offered, text from a `<tool_call>` (or what may be its start) on is held back, and so is
    trailing whitespace, which a following call would strip. The deltas add up to the parsed reply's content."""

    def __init__(self, response_prefix: str = "", tools_offered: bool = False):
        self.text, self.sent, self.tools_offered = response_prefix, 0, tools_offered

    def feed(self, piece: str) -> str:
        """The content delta this piece makes safe to show."""
        self.text += piece
        safe = self._safe_length() if self.tools_offered else len(self.text)
        delta = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta

    def finish(self) -> tuple[str, ParsedReply]:
        """The content not shown yet, and the whole reply parsed."""
        reply = self.parsed()
        return reply.content[self.sent:], reply

    def parsed(self) -> ParsedReply:
        return parse_tool_calls(self.text) if self.tools_offered else ParsedReply(self.text, [], [])

    def _safe_length(self) -> int:
        opened = self.text.find(CALL_OPEN)
        if opened < 0:
            opened = len(self.text) - max((k for k in range(1, len(CALL_OPEN)) if self.text.endswith(CALL_OPEN[:k])),
                                          default=0)
        return len(self.text[:opened].rstrip())
