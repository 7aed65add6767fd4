"""The fused model as a LangChain chat model: messages go through every member's own chat template, tools are
bound as in other chat integrations, and replies come back as `AIMessage`s with tool calls and usage."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call, tool_call_chunk
from langchain_core.messages.utils import convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from adafuse import Chat
from adafuse.result import GenerationResult
from adafuse.tools import ReplyStream, ToolChoice
from adafuse.streaming import iterate_in_thread

from .._common import engine_options, generation_info
from ._fields import AdaFuseFields

__all__ = ["ChatAdaFuse"]


class ChatAdaFuse(AdaFuseFields, BaseChatModel):
    """Several local models fused word by word (AdaFuse) behind LangChain's chat model interface.

    Each member renders the conversation with its own chat template (tools included, through the template's
    `tools` support or, where it has none, in the system message as `adafuse.tools` describes). Every
    `FusionConfig` field (tau_delta, max_span_words, num_branches, ...) is a field here too.

    Example:
        .. code-block:: python

            from adafuse_integrations.langchain import ChatAdaFuse

            chat = ChatAdaFuse(max_new_tokens=64)
            chat.invoke([("system", "Answer briefly."), ("human", "Who wrote Hamlet?")])
            chat.bind_tools([get_weather]).invoke("What is the weather in Paris?").tool_calls
    """

    @property
    def _llm_type(self) -> str:
        return "adafuse-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("chat", stop, kwargs)

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: ToolChoice = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer `tools` to the model. `tool_choice`: "auto" (default), "none", "any"/"required"/True (the reply
        must be a call), or a tool name / {"type": "function", "function": {"name": ...}} (a call of that tool)."""
        return super().bind(tools=[convert_to_openai_tool(t) for t in tools], tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Replies that match `schema` (a Pydantic class, TypedDict or JSON schema), parsed.

        "json_schema" constrains the reply's text to the schema's JSON (the fused members' candidates are cut to
        what the schema still allows, and a reply cut short by the budget is closed), so it always parses;
        "function_calling" forces a call of the schema as a tool, its arguments constrained the same way;
        "json_mode" constrains the reply to some JSON object."""
        kwargs.pop("strict", None)
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}")
        if method == "json_mode":
            json_schema: dict[str, Any] = {"type": "object"}
        elif isinstance(schema, dict) and ("properties" in schema or "type" in schema):
            json_schema = schema  # a JSON schema as it is (LangChain's conversion wants a title to name a function)
        else:
            json_schema = convert_to_json_schema(schema)
        llm = self.bind(json_schema=json_schema,
                        ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema})
        pydantic_class = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic_class and method == "json_schema" else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # ------------------------------------------------------------------ calls into the engine
    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
                 ) -> tuple[Chat, dict[str, Any]]:
        """The engine prompt (messages, tools, forced start of the reply) and options of one call."""
        kwargs = dict(kwargs)
        chat = Chat.with_tools(convert_to_openai_messages(messages), kwargs.pop("tools", None), kwargs.pop("tool_choice", None))
        return chat, engine_options(self, stop, kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chat, options = self._request(messages, stop, kwargs)
        result = self.engine.batcher.generate(chat, **options)
        replying = chat.reply_stream()
        replying.feed(result.text)
        reply = replying.parsed()
        message = AIMessage(
            content=reply.content,
            tool_calls=[tool_call(name=c.name, args=c.arguments, id=c.id) for c in reply.tool_calls],
            invalid_tool_calls=[invalid_tool_call(name=c.name, args=c.text, id=c.id, error=c.error)
                                for c in reply.invalid_tool_calls],
            usage_metadata=self._usage(result),
            response_metadata=self._response_metadata(result),
        )
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=generation_info(result))],
                          llm_output={"model_name": self.model_name, "token_usage": dict(message.usage_metadata)})

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    def _chunks(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
                ) -> Iterator[ChatGenerationChunk]:
        """Text as rounds commit it; with tools, text from a `<tool_call>` on is held back and the calls arrive in
        the last chunk, with the usage. The chunks add up to the message `invoke` returns."""
        chat, options = self._request(messages, stop, kwargs)
        replying = chat.reply_stream()
        for piece in self.engine.batcher.stream(chat, **options):
            if isinstance(piece, GenerationResult):
                yield self._last_chunk(replying, piece)
            elif delta := replying.feed(piece):
                yield ChatGenerationChunk(message=AIMessageChunk(content=delta))

    def _last_chunk(self, replying: ReplyStream, result: GenerationResult) -> ChatGenerationChunk:
        rest, reply = replying.finish()
        calls = [tool_call_chunk(name=c.name, args=json.dumps(c.arguments, ensure_ascii=False), id=c.id, index=i)
                 for i, c in enumerate(reply.tool_calls)]
        calls += [tool_call_chunk(name=c.name, args=c.text, id=c.id, index=len(calls) + i)
                  for i, c in enumerate(reply.invalid_tool_calls)]
        message = AIMessageChunk(content=rest, tool_call_chunks=calls, usage_metadata=self._usage(result),
                                 response_metadata=self._response_metadata(result), chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info=generation_info(result))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(messages, stop, kwargs)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ reply metadata
    def _usage(self, result: GenerationResult) -> UsageMetadata:
        """Tokens counted with the first member's tokenizer, as the budget is."""
        prompt = result.stats.prompt_tokens.get(self.engine.model_names[0], 0)
        return UsageMetadata(input_tokens=prompt, output_tokens=result.stats.new_tokens,
                             total_tokens=prompt + result.stats.new_tokens)

    def _response_metadata(self, result: GenerationResult) -> dict[str, Any]:
        return {"model_name": self.model_name, "model_provider": "adafuse", "finish_reason": result.finish_reason,
                "rounds": result.stats.rounds, "forward_passes": result.stats.forward_passes}
