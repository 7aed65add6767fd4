"""Chat prompts with tools: rendering per member, reading tool calls back, and the chat adapters of both
frameworks (LangChain `ChatAdaFuse`, LlamaIndex `FunctionCallingLLM`) over a tiny pair with long windows."""
import asyncio
import json

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from conftest import _byte_level_tokenizer  # noqa: E402
from langchain_core.caches import InMemoryCache  # noqa: E402
from langchain_core.globals import set_llm_cache  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, ToolCallBlock  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

from adafuse import Chat  # noqa: E402
from adafuse.chat import render_chat  # noqa: E402
from adafuse.tools import CALL_OPEN, ReplyStream, forced_call_prefix, parse_tool_calls, tool_instructions  # noqa: E402
from adafuse_integrations.langchain import AdaFuseLLM, ChatAdaFuse  # noqa: E402
from adafuse_integrations.llama_index import AdaFuseLLM as LlamaIndexLLM  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]

# A template with tool support, in the shape of Qwen's: tools as JSON in the system turn, tool turns as their own.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(long_pair) -> ChatAdaFuse:
    return ChatAdaFuse(engine=long_pair, max_new_tokens=8)


@pytest.fixture(scope="module")
def li_llm(long_pair) -> LlamaIndexLLM:
    return LlamaIndexLLM(engine=long_pair, max_new_tokens=8)


@tool
def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


# ---------------------------------------------------------------------- rendering
def test_each_member_renders_the_conversation_with_its_own_template(long_pair):
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    for backend in long_pair.backends:
        template = backend.tokenizer.chat_template
        assert backend.render(messages) == render_chat(backend.tokenizer, backend.model_type, messages)
        if template is None and backend.model_type.startswith("gemma"):
            assert backend.render(messages).count("<start_of_turn>") == 2  # the system text folds into the user turn
    llama = long_pair.backends[0].tokenizer
    llama.chat_template = TOOL_TEMPLATE
    try:
        expected = llama.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        assert long_pair.backends[0].render(Chat(messages, [WEATHER])) == expected
        assert json.dumps(WEATHER) in expected
    finally:
        llama.chat_template = None


def test_template_without_tool_support_gets_tools_and_turns_in_text():
    tokenizer = _byte_level_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE.replace("{% if tools %}", "{% if false %}").replace("tools", "x")
    conversation = [*QUESTION,
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                    {"role": "tool", "content": "warm", "tool_call_id": "c2"}]
    text = render_chat(tokenizer, "llama", conversation, [WEATHER])
    assert text.startswith("<|im_start|>system\n" + tool_instructions([WEATHER]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>" in text
    assert "role" not in text and "tool_call_id" not in text


def test_tool_choice_forces_the_start_of_the_reply():
    assert forced_call_prefix([WEATHER], "auto") == forced_call_prefix([WEATHER], None) == ""
    assert forced_call_prefix([WEATHER], "required") == CALL_OPEN + '\n{"name": "get_weather", "arguments": '
    assert forced_call_prefix([WEATHER, TIME], "any") == CALL_OPEN + '\n{"name": "'
    assert forced_call_prefix([WEATHER, TIME], "get_time").endswith('"get_time", "arguments": ')
    assert forced_call_prefix([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}).endswith('"get_time", "arguments": ')
    with pytest.raises(ValueError, match="get_wether"):
        forced_call_prefix([WEATHER], "get_wether")
    assert Chat.with_tools(QUESTION, [WEATHER], "none") == Chat(QUESTION)


# ---------------------------------------------------------------------- reading calls back
def test_parse_tool_calls_valid_malformed_and_unclosed():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "parameters": "{}"}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}')
    reply = parse_tool_calls(text)
    assert reply.content == "Let me check."
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {}),
                                                                 ("get_time", {})]
    assert len({c.id for c in reply.tool_calls}) == 3
    [bad] = reply.invalid_tool_calls
    assert bad.name == "get_weather" and bad.text.endswith('"city":') and "not valid JSON" in bad.error
    assert parse_tool_calls("no calls here ").content == "no calls here "  # text without calls stays as generated
    assert parse_tool_calls('<tool_call>["not", "an object"]</tool_call>').invalid_tool_calls[0].name is None


def test_reply_stream_holds_back_calls_and_partial_tags():
    text = 'It is <b>sunny</b>.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    stream, shown = ReplyStream("", tools_offered=True), ""
    for char in text:
        delta = stream.feed(char)
        shown += delta
        assert CALL_OPEN not in shown and not CALL_OPEN.startswith(shown[-3:]) or len(shown) < 3
    rest, reply = stream.finish()
    assert shown + rest == reply.content == parse_tool_calls(text).content == "It is <b>sunny</b>."
    assert [c.name for c in reply.tool_calls] == ["get_time"]
    forced = ReplyStream(forced_call_prefix([TIME], "required"), tools_offered=True)
    assert forced.feed("{}}\n</tool_call>") == ""
    assert [(c.name, c.arguments) for c in forced.finish()[1].tool_calls] == [("get_time", {})]


# ---------------------------------------------------------------------- LangChain chat model
def test_chat_model_reply_equals_engine_and_reports_usage(chat_model, long_pair):
    result = long_pair.generate(QUESTION, max_new_tokens=8)
    message = chat_model.invoke([HumanMessage("What is the weather in Paris?")])
    assert isinstance(message, AIMessage) and message.content == result.text
    assert message.usage_metadata == {"input_tokens": result.stats.prompt_tokens["tiny-llama"],
                                      "output_tokens": result.stats.new_tokens,
                                      "total_tokens": result.stats.prompt_tokens["tiny-llama"] + result.stats.new_tokens}
    assert message.response_metadata["finish_reason"] == result.finish_reason
    assert message.response_metadata["rounds"] == result.stats.rounds >= 1
    assert set(message.response_metadata["forward_passes"]) == {"tiny-llama", "tiny-gemma"}


def test_chat_model_system_message_reaches_the_templates(chat_model, long_pair):
    messages = [SystemMessage("Answer in French."), HumanMessage("What is the weather in Paris?")]
    expected = long_pair.generate([{"role": "system", "content": "Answer in French."}, *QUESTION], max_new_tokens=8)
    assert chat_model.invoke(messages).content == expected.text


def test_chat_model_stream_and_async_add_up_to_invoke(chat_model):
    message = chat_model.invoke("What is the weather in Paris?")
    chunks = list(chat_model.stream("What is the weather in Paris?"))
    assert len(chunks) > 1 and chunks[-1].chunk_position == "last"
    total = sum(chunks[1:], chunks[0])
    assert total.content == message.content and total.usage_metadata == message.usage_metadata

    async def run():
        done = await chat_model.ainvoke("What is the weather in Paris?")
        pieces = [c async for c in chat_model.astream("What is the weather in Paris?")]
        return done, sum(pieces[1:], pieces[0])

    done, streamed = asyncio.run(run())
    assert done.content == streamed.content == message.content


def test_bound_tool_with_required_choice_comes_back_as_a_call(chat_model):
    bound = chat_model.bind_tools([get_weather], tool_choice="required")
    message = bound.invoke("What is the weather in Paris?")
    calls = message.tool_calls + message.invalid_tool_calls
    assert len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert CALL_OPEN not in message.content
    streamed = list(bound.stream("What is the weather in Paris?"))
    total = sum(streamed[1:], streamed[0])
    assert [c["name"] for c in total.tool_call_chunks] == ["get_weather"]


def test_tool_round_trip_renders_the_result_for_the_next_turn(chat_model, long_pair):
    call = {"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}
    history = [HumanMessage("What is the weather in Paris?"), AIMessage("", tool_calls=[call]),
               ToolMessage("sunny in Paris", tool_call_id="call_1")]
    chat = Chat.with_tools([{"role": "user", "content": "What is the weather in Paris?"},
                            {"role": "assistant", "content": "", "tool_calls": [
                                {"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                            {"role": "tool", "content": "sunny in Paris", "tool_call_id": "call_1"}], [WEATHER])
    rendered = long_pair.backends[1].render(chat)
    assert "<tool_response>\nsunny in Paris\n</tool_response>" in rendered and '"city": "Paris"' in rendered
    replying = chat.reply_stream()
    replying.feed(long_pair.generate(chat, max_new_tokens=8).text)
    assert chat_model.bind_tools([WEATHER]).invoke(history).content == replying.parsed().content


def test_cache_keys_include_decoding_overrides(long_pair):
    cache = InMemoryCache()
    set_llm_cache(cache)
    try:
        llm = AdaFuseLLM(engine=long_pair, max_new_tokens=8)
        prompt = "The quick brown fox"
        assert llm.invoke(prompt) == llm.invoke(prompt)
        assert len(cache._cache) == 1
        forced = llm.invoke(prompt, tau_delta=1.0, num_branches=1)
        assert len(cache._cache) == 2
        assert forced == long_pair.generate(prompt, max_new_tokens=8, tau_delta=1.0, num_branches=1).text
    finally:
        set_llm_cache(None)


def test_langsmith_params_and_token_counts(chat_model, long_pair):
    params = chat_model._get_ls_params(stop=["\n"])
    assert params["ls_provider"] == "adafuse" and params["ls_model_name"] == "adafuse(tiny-llama+tiny-gemma)"
    assert params["ls_max_tokens"] == 8 and params["ls_stop"] == ["\n"] and "ls_temperature" not in params
    assert chat_model._get_ls_params(exploration="sample", temperature=0.5)["ls_temperature"] == 0.5
    tokenizer = long_pair.backends[0].tokenizer
    assert chat_model.get_num_tokens("The quick brown fox") == len(tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]) > 0


def test_new_tokens_count_what_is_kept_after_a_stop(long_pair):
    free = long_pair.generate("The quick brown fox", max_new_tokens=12)
    stop = free.text[len(free.text) // 2:][:2]
    cut = long_pair.generate("The quick brown fox", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    kept = long_pair.backends[0].tokenizer(cut.text, add_special_tokens=False)["input_ids"]
    assert cut.stats.new_tokens == len(kept) < free.stats.new_tokens


# ---------------------------------------------------------------------- LlamaIndex function-calling LLM
class _Events(BaseEventHandler):
    names: list = []

    @classmethod
    def class_name(cls) -> str:
        return "_Events"

    def handle(self, event, **kwargs) -> None:
        self.names.append(event.class_name())


@pytest.fixture()
def events():
    handler, root = _Events(names=[]), get_dispatcher()
    root.add_event_handler(handler)
    yield handler.names
    root.event_handlers.remove(handler)


def test_llama_index_chat_goes_through_the_templates(li_llm, long_pair):
    meta = li_llm.metadata
    assert meta.is_chat_model and meta.is_function_calling_model
    reply = li_llm.chat([ChatMessage(role="system", content="Answer in French."),
                         ChatMessage(role="user", content="What is the weather in Paris?")])
    expected = long_pair.generate([{"role": "system", "content": "Answer in French."}, *QUESTION], max_new_tokens=8)
    assert reply.message.content == expected.text
    assert reply.raw["usage"] == {"prompt_tokens": expected.stats.prompt_tokens["tiny-llama"],
                                  "completion_tokens": expected.stats.new_tokens,
                                  "total_tokens": expected.stats.prompt_tokens["tiny-llama"] + expected.stats.new_tokens}
    streamed = list(li_llm.stream_chat([ChatMessage(role="user", content="What is the weather in Paris?")]))
    assert "".join(r.delta for r in streamed) == streamed[-1].message.content == li_llm.chat(
        [ChatMessage(role="user", content="What is the weather in Paris?")]).message.content


def test_llama_index_events_are_emitted_once_per_call(li_llm, events):
    messages = [ChatMessage(role="user", content="What is the weather in Paris?")]

    async def run():
        await li_llm.achat(messages)
        [r async for r in await li_llm.astream_chat(messages)]
        await li_llm.acomplete("The quick brown fox")
        [r async for r in await li_llm.astream_complete("The quick brown fox")]

    asyncio.run(run())
    assert events.count("LLMChatStartEvent") == 2 and events.count("LLMChatEndEvent") == 2
    assert events.count("LLMCompletionStartEvent") == 2 and events.count("LLMCompletionEndEvent") == 2


def test_llama_index_async_chat_leaves_the_event_loop_free(li_llm):
    messages = [ChatMessage(role="user", content="What is the weather in Paris?")]

    async def run():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.create_task(tick())
        reply = await li_llm.achat(messages)
        ticker.cancel()
        return reply, ticks

    reply, ticks = asyncio.run(run())
    assert ticks > 1 and reply.message.content == li_llm.chat(messages).message.content


def test_llama_index_function_calling(li_llm):
    def get_weather_li(city: str) -> str:
        """Weather in a city."""
        return f"sunny in {city}"

    weather = FunctionTool.from_defaults(get_weather_li)
    response = li_llm.chat_with_tools([weather], user_msg="What is the weather in Paris?", tool_required=True)
    blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
    assert len(blocks) == 1 and blocks[0].tool_name == "get_weather_li"
    [selection] = li_llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "get_weather_li" and selection.tool_id == blocks[0].tool_call_id
    with pytest.raises(ValueError, match="expected a tool call"):
        li_llm.get_tool_calls_from_response(li_llm.chat([ChatMessage(role="user", content="hi")]))
    assert li_llm.get_tool_calls_from_response(li_llm.chat([ChatMessage(role="user", content="hi")]),
                                               error_on_no_tool_call=False) == []


def test_llama_index_tool_turns_become_template_turns(li_llm, long_pair):
    history = [ChatMessage(role="user", content="What is the weather in Paris?"),
               ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_call_id="c1", tool_name="get_weather",
                                                                   tool_kwargs={"city": "Paris"})]),
               ChatMessage(role="tool", content="sunny in Paris", additional_kwargs={"tool_call_id": "c1"})]
    reply = li_llm.chat(history, tools=[WEATHER])
    expected = Chat.with_tools([*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny in Paris", "tool_call_id": "c1"}], [WEATHER])
    replying = expected.reply_stream()
    replying.feed(long_pair.generate(expected, max_new_tokens=8).text)
    assert reply.message.content == replying.parsed().content


def test_llama_index_tokenizer_and_bad_messages(li_llm, long_pair):
    tokenizer = long_pair.backends[0].tokenizer
    assert li_llm.tokenizer("The quick brown fox") == tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    with pytest.raises(TypeError, match="ChatMessage"):
        li_llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="text only.*ImageBlock"):
        li_llm.chat([ChatMessage(role="user", blocks=[ImageBlock(url="http://example.com/a.png")])])
