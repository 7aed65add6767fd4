"""Agents of both frameworks on the embedded default pair: the tool-calling loop runs end to end (what the tiny
models choose to call is theirs; every call they make is executed and answered)."""
import asyncio

import pytest

from adafuse import AdaFuse

pytestmark = pytest.mark.e2e
agents = pytest.importorskip("langchain.agents")
CAPITALS = {"france": "Paris", "japan": "Tokyo", "zubrowka": "Lutz"}
QUESTION = "Call capital_of to find the capital of Zubrowka."


def capital_of(country: str) -> str:
    """Look up the capital city of a country."""
    return CAPITALS.get(country.strip().lower(), "unknown")


@pytest.fixture(scope="module")
def default_pair() -> AdaFuse:
    return AdaFuse.from_pretrained()


def test_langchain_create_agent_runs_the_tool_loop(default_pair):
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool

    from adafuse_integrations.langchain import ChatAdaFuse

    chat = ChatAdaFuse(engine=default_pair, max_new_tokens=48)
    agent = agents.create_agent(chat, tools=[tool(capital_of)], system_prompt="Use the tools to answer.")
    messages = agent.invoke({"messages": [("user", QUESTION)]})["messages"]
    calls = [c["id"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    answered = [m.tool_call_id for m in messages if isinstance(m, ToolMessage)]
    assert calls == answered
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls and "<tool_call>" not in messages[-1].content

    forced = chat.bind_tools([capital_of], tool_choice="capital_of").invoke("What is the capital of Japan?")
    assert [c["name"] for c in forced.tool_calls + forced.invalid_tool_calls] == ["capital_of"]


def test_llama_index_function_agent_runs_the_tool_loop(default_pair):
    from llama_index.core.agent.workflow import FunctionAgent, ToolCall, ToolCallResult
    from llama_index.core.tools import FunctionTool

    from adafuse_integrations.llama_index import AdaFuseLLM

    llm = AdaFuseLLM(engine=default_pair, max_new_tokens=48)
    tool = FunctionTool.from_defaults(capital_of)
    agent = FunctionAgent(tools=[tool], llm=llm, system_prompt="Use the tools to answer.")

    async def run():
        handler = agent.run(QUESTION)
        seen = [type(event) async for event in handler.stream_events() if isinstance(event, (ToolCall, ToolCallResult))]
        return seen, await handler

    seen, response = asyncio.run(run())
    assert seen.count(ToolCallResult) == len(seen) / 2 and isinstance(str(response), str)
    assert "<tool_call>" not in str(response)

    result = llm.predict_and_call([tool], "What is the capital of Japan?", tool_required=True)
    assert [s.tool_name for s in result.sources] == ["capital_of"]
