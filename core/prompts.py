"""What a prompt may be, checked in one place before any model work: a string, chat messages, or a `Chat` (messages
with tools and a forced start of the reply)."""
from __future__ import annotations

import dataclasses
from typing import Any

from .chat import Chat, Message, normalize_tool_calls
from .tools import check_tools

Prompt = str | list[Message] | Chat

ROLES = ("system", "user", "assistant", "tool")


def normalize_prompts(prompt: Any) -> tuple[list[Prompt], bool]:
    """The prompts of one engine call and whether the caller passed a single one.

    A string, a chat message dict or a list of messages is one prompt; any other list is a batch of prompts.
    """
    if isinstance(prompt, (str, dict, Chat)) or _looks_like_messages(prompt):
        return [normalize_prompt(prompt)], True
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("no prompt given: the list of prompts is empty")
        return [normalize_prompt(p, index=i if len(prompt) > 1 else None) for i, p in enumerate(prompt)], False
    return [normalize_prompt(prompt)], True


def normalize_prompt(prompt: Any, index: int | None = None) -> Prompt:
    """`prompt` as a non-empty string, a list of {'role', 'content'} messages with string content, or a `Chat` of
    such messages and checked tools."""
    where = "prompt" if index is None else f"prompt {index}"
    if isinstance(prompt, Chat):
        if not isinstance(prompt.response_prefix, str):
            raise TypeError(f"{where}: response_prefix must be a string")
        if prompt.reply_pattern is not None and not isinstance(prompt.reply_pattern, str):
            raise TypeError(f"{where}: reply_pattern must be a regex string or None")
        tools = check_tools(prompt.tools) if prompt.tools is not None else None
        messages = normalize_prompt(prompt.messages, index)
        if isinstance(messages, str):
            raise TypeError(f"{where}: a Chat holds a list of messages, not a string")
        return dataclasses.replace(prompt, messages=messages, tools=tools)
    if isinstance(prompt, str):
        _check_text(prompt, where)
        if not prompt.strip():
            raise ValueError(f"{where} is empty")
        return prompt
    if isinstance(prompt, dict):
        prompt = [prompt]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return [_normalize_message(m, f"{where}, message {i}") for i, m in enumerate(prompt)]
    if isinstance(prompt, (bytes, bytearray)):
        raise TypeError(f"{where} is bytes; decode it to a string first (e.g. data.decode('utf-8'))")
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError(f"{where} is an empty list of chat messages")
    raise TypeError(f"{where} must be a string or a list of chat messages, not {type(prompt).__name__}")


def _normalize_message(message: dict, where: str) -> Message:
    role, content = message.get("role"), message.get("content")
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {list(ROLES)}, got {role!r}")
    if role == "assistant" and message.get("tool_calls"):
        message = {**message, "tool_calls": normalize_tool_calls(message["tool_calls"], where)}
        content = content or ""
    if isinstance(content, (list, tuple)):
        content = "".join(_text_part(part, where) for part in content)
    if not isinstance(content, str):
        raise TypeError(f"{where}: content must be a string or a list of text parts, not {type(content).__name__}")
    _check_text(content, where)
    return {**message, "content": content}


def _text_part(part: Any, where: str) -> str:
    """The text of one OpenAI-style content part ({'type': 'text', 'text': ...}); other kinds are refused."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"{where}: only text content parts are supported, got {kind!r}")


def _check_text(text: str, where: str) -> None:
    """Refuse what no tokenizer can encode: a lone surrogate, left by decoding bytes that were not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{where} holds an unpaired surrogate at character {error.start}: it is not valid "
                         "Unicode text (bytes decoded with errors='surrogateescape'?)") from None


def _looks_like_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)
