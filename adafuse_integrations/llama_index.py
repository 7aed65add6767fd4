"""LlamaIndex backend: the fused model as a `FunctionCallingLLM`, usable as `Settings.llm` in query engines and as
the model of a `FunctionAgent`. Chats go through every member's own chat template; completions stay plain text."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import closing
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen,
                                              CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole, TextBlock, ThinkingBlock, ToolCallBlock)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from adafuse import AdaFuse, Chat
from adafuse.models import DEFAULT_ENSEMBLE
from adafuse.result import GenerationResult
from adafuse.tools import ParsedReply
from adafuse.streaming import iterate_in_thread

from ._common import DecodingParameters, build_engine, decoding_config, engine_options, generation_info

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["AdaFuseLLM"]

# LlamaIndex's roles as the chat templates know them.
_ROLES = {MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system", MessageRole.USER: "user",
          MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
          MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool"}


class AdaFuseLLM(FunctionCallingLLM, DecodingParameters):
    """Several local models fused word by word (AdaFuse) behind LlamaIndex's LLM interface.

    Every `FusionConfig` field (tau_delta, max_span_words, num_branches, ...) is a field here too. Tools offered
    through `chat_with_tools` / `FunctionAgent` reach each member through its template's tool support, or in the
    system message in the format `adafuse.tools` describes; calls come back as `ToolCallBlock`s.

    Example:
        .. code-block:: python

            from llama_index.core import Settings
            from adafuse_integrations.llama_index import AdaFuseLLM

            Settings.llm = AdaFuseLLM(max_new_tokens=64)  # models=[...] for others than the embedded defaults
            Settings.tokenizer = Settings.llm.tokenizer
    """

    models: list[str] = Field(default_factory=lambda: list(DEFAULT_ENSEMBLE), description="model names, ids, folders or served models (vllm:URL#name)")
    device_map: Any = Field(default=None, description="accelerate device map, e.g. 'cuda'")
    dtype: Any = Field(default=None, description="torch dtype, e.g. 'bfloat16'")
    stop: list[str] | None = Field(default=None, description="stop sequences")

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())
    _engine: AdaFuse = PrivateAttr()

    def __init__(self, engine: AdaFuse | None = None, **kwargs: Any) -> None:
        if engine is not None:
            kwargs.setdefault("models", engine.model_names)
        super().__init__(**kwargs)
        config = decoding_config(self)
        self._engine = engine if engine is not None else build_engine(self.models, config, self.device_map, self.dtype)
        self._engine.check_config(config)

    @classmethod
    def class_name(cls) -> str:
        return "AdaFuseLLM"

    @property
    def engine(self) -> AdaFuse:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_window,
            num_output=self.max_new_tokens,
            model_name="adafuse(" + "+".join(self._engine.model_names) + ")",
            is_chat_model=True,
            is_function_calling_model=True,
        )

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """Token ids under the first model's tokenizer (the one budgets are counted in), for `Settings.tokenizer`."""
        tokenizer = self._engine.backends[0].tokenizer
        return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]

    # ------------------------------------------------------------------ completion: the text as given
    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(kwargs)
        kwargs.pop("formatted", None)
        return engine_options(self, kwargs.pop("stop", None), kwargs)

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        result = self._engine.batcher.generate(prompt if formatted else self.completion_to_prompt(prompt), **self._options(kwargs))
        return CompletionResponse(text=result.text, additional_kwargs=generation_info(result), raw=self._raw(result))

    def _stream_complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponseGen:
        pieces = self._engine.batcher.stream(prompt if formatted else self.completion_to_prompt(prompt), **self._options(kwargs))
        text = ""
        with closing(pieces):
            for piece in pieces:
                if isinstance(piece, GenerationResult):
                    yield CompletionResponse(text=text, delta="", additional_kwargs=generation_info(piece),
                                             raw=self._raw(piece))
                else:
                    text += piece
                    yield CompletionResponse(text=text, delta=piece)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return iterate_in_thread(lambda: self._stream_complete(prompt, formatted, kwargs))

    # ------------------------------------------------------------------ chat: each member's template, tools
    def _request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[Chat, dict[str, Any]]:
        kwargs = dict(kwargs)
        chat = Chat.with_tools(_as_dicts(messages), kwargs.pop("tools", None), kwargs.pop("tool_choice", None))
        return chat, self._options(kwargs)

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        chat, options = self._request(messages, kwargs)
        result = self._engine.batcher.generate(chat, **options)
        replying = chat.reply_stream()
        replying.feed(result.text)
        return ChatResponse(message=_reply_message(replying.parsed()), additional_kwargs=generation_info(result),
                            raw=self._raw(result))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        """Text as rounds commit it (from a `<tool_call>` on it is held back); the calls come in the last response."""
        chat, options = self._request(messages, kwargs)
        replying, text = chat.reply_stream(), ""
        pieces = self._engine.batcher.stream(chat, **options)
        with closing(pieces):
            for piece in pieces:
                if isinstance(piece, GenerationResult):
                    rest, reply = replying.finish()
                    yield ChatResponse(message=_reply_message(reply), delta=rest,
                                       additional_kwargs=generation_info(piece), raw=self._raw(piece))
                elif delta := replying.feed(piece):
                    text += delta
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return iterate_in_thread(lambda: self._stream_chat(messages, kwargs))

    # ------------------------------------------------------------------ function calling
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        tool_choice = kwargs.pop("tool_choice", None) or ("required" if tool_required else None)
        return {"messages": messages, "tools": [t.metadata.to_openai_tool(skip_length_check=True) for t in tools] or None,
                "tool_choice": tool_choice, **kwargs}

    def _validate_chat_with_tools_response(self, response: ChatResponse, tools: Sequence[BaseTool],
                                           allow_parallel_tool_calls: bool = False, **kwargs: Any) -> ChatResponse:
        """One call unless parallel calls are allowed, as other function-calling LLMs do."""
        if not allow_parallel_tool_calls:
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            response.message.blocks = [b for b in response.message.blocks if not isinstance(b, ToolCallBlock)] + calls[:1]
        return response

    def get_tool_calls_from_response(self, response: ChatResponse, error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = [ToolSelection(tool_id=b.tool_call_id or "", tool_name=b.tool_name, tool_kwargs=b.tool_kwargs)
                 for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call in the reply, got none: {response.message.content!r}")
        return calls

    # ------------------------------------------------------------------ reply metadata
    def _raw(self, result: GenerationResult) -> dict[str, Any]:
        """Usage as OpenAI reports it (what LlamaIndex's token counter reads), counted with the first member's
        tokenizer as the budget is."""
        prompt = result.stats.prompt_tokens.get(self._engine.model_names[0], 0)
        return {"model": self.metadata.model_name, "finish_reason": result.finish_reason,
                "usage": {"prompt_tokens": prompt, "completion_tokens": result.stats.new_tokens,
                          "total_tokens": prompt + result.stats.new_tokens}}


def _as_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as the role/content dicts (OpenAI shape, tool calls included) the engine renders."""
    converted = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise TypeError(f"message {i} must be a ChatMessage, not {type(message).__name__}")
        unsupported = {type(b).__name__ for b in message.blocks if not isinstance(b, (TextBlock, ThinkingBlock, ToolCallBlock))}
        if unsupported:
            raise ValueError(f"message {i}: adafuse models read text only, not {sorted(unsupported)}")
        entry: dict[str, Any] = {"role": _ROLES[MessageRole(message.role)], "content": message.content or ""}
        calls = [{"id": b.tool_call_id, "type": "function", "function": {"name": b.tool_name, "arguments": b.tool_kwargs}}
                 for b in message.blocks if isinstance(b, ToolCallBlock)] or message.additional_kwargs.get("tool_calls")
        if entry["role"] == "assistant" and calls:
            entry["tool_calls"] = [c if isinstance(c, dict) else c.model_dump() for c in calls]
        if entry["role"] == "tool" and "tool_call_id" in message.additional_kwargs:
            entry["tool_call_id"] = message.additional_kwargs["tool_call_id"]
        converted.append(entry)
    return converted


def _reply_message(reply: ParsedReply) -> ChatMessage:
    """The assistant message: its text, then one `ToolCallBlock` per call (a malformed call keeps its raw text)."""
    blocks: list[Any] = [TextBlock(text=reply.content)]
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in reply.tool_calls]
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name or "", tool_kwargs=c.text) for c in reply.invalid_tool_calls]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)

