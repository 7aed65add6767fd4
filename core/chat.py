"""Rendering chat messages (and the tools a reply may call) with each model's own template."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from .tools import (RESPONSE_CLOSE, RESPONSE_OPEN, ReplyStream, ToolChoice, check_tools, forced_call_pattern,
                    forced_call_prefix, format_call, tool_instructions)

Message = dict[str, Any]

# GGUF files do not always carry a chat template; these are the published formats of such families.
_FALLBACK_TEMPLATES = {
    "gemma3_text": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
        "{% if m['role'] == 'system' %}{{ '<start_of_turn>user\n' + m['content'] + '\n\n' }}{% set ns = 1 %}"
        "{% else %}{% if role == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system' %}"
        "{{ m['content'] + '<end_of_turn>\n' }}{% else %}{{ '<start_of_turn>' + role + '\n' + m['content'] + '<end_of_turn>\n' }}"
        "{% endif %}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}
_FALLBACK_TEMPLATES["gemma3"] = _FALLBACK_TEMPLATES["gemma3_text"]
_FALLBACK_TEMPLATES["gemma2"] = _FALLBACK_TEMPLATES["gemma3_text"]


@dataclass(frozen=True)
class Chat:
    """A conversation to answer: the messages, the tools the reply may call (OpenAI function tools), text the reply
    is made to start with (the rendered prompt ends with it; the generated text does not include it), and a regex
    the generated text must match (a forced call's arguments and closing), unless the call sets a constraint."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    response_prefix: str = ""
    reply_pattern: str | None = None

    @classmethod
    def with_tools(cls, messages: list[Message], tools: list[dict[str, Any]] | None = None,
                   tool_choice: ToolChoice = None) -> "Chat":
        """The conversation offering `tools` under an OpenAI-style `tool_choice` (a required call is forced by
        starting the reply with one)."""
        if not tools or tool_choice in ("none", False):
            return cls(messages)
        tools = check_tools(tools)
        return cls(messages, tools, forced_call_prefix(tools, tool_choice), forced_call_pattern(tools, tool_choice))

    def reply_stream(self) -> ReplyStream:
        """Where the reply's text goes to be split into content and tool calls."""
        return ReplyStream(self.response_prefix, bool(self.tools))


def render_chat(tokenizer: PreTrainedTokenizerBase, model_type: str, messages: list[Message],
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for `messages` under this model's chat template, ending with the assistant cue.

    A template that takes `tools` gets them and the tool turns as they are; for one that does not, the tools are
    described in the system message, past calls written into the assistant turns and tool results given back in
    user turns, in the format of `adafuse.tools`.
    """
    if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    template = tokenizer.chat_template or _FALLBACK_TEMPLATES.get(model_type)
    if template is None or "tools" not in template:
        messages, tools = _tools_in_text(messages, tools), None
    if template is None:
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nAssistant:"
    return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=template, tokenize=False,
                                         add_generation_prompt=True)


def _tools_in_text(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
    """The conversation with tools, tool calls and tool results written as plain text turns."""
    rendered: list[Message] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [format_call(c["function"]["name"], c["function"]["arguments"])
                     for c in normalize_tool_calls(m["tool_calls"], "assistant message")]
            rendered.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], *calls]))})
        elif m["role"] == "tool":
            result = f"{RESPONSE_OPEN}\n{m['content']}\n{RESPONSE_CLOSE}"
            if rendered and rendered[-1].get("tool_results"):
                rendered[-1]["content"] += "\n" + result
            else:
                rendered.append({"role": "user", "content": result, "tool_results": True})
        else:
            rendered.append({"role": m["role"], "content": m["content"]})
    rendered = [{"role": m["role"], "content": m["content"]} for m in rendered]
    if tools:
        instructions = tool_instructions(tools)
        if rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + instructions}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Assistant tool calls as [{'id', 'type': 'function', 'function': {'name', 'arguments'}}], arguments a dict:
    OpenAI sends them as a JSON string, templates expect an object. Arguments that are not valid JSON (a malformed
    call a model made earlier in the conversation) stay the string the model wrote, so the history is kept as it was."""
    if not isinstance(calls, (list, tuple)):
        raise TypeError(f"{where}: tool_calls must be a list, not {type(calls).__name__}")
    normalized = []
    for i, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: tool call {i} has no function name")
        arguments = function.get("arguments", function.get("args", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        normalized.append({"id": call.get("id"), "type": "function",
                           "function": {"name": function["name"], "arguments": arguments}})
    return normalized
