"""Constrained output: the character automaton, and fused answers that always match their JSON schema or regex."""
import json

import pytest
from pydantic import BaseModel

from adafuse import FusionConfig
from adafuse.constraints import TextAutomaton, compile_constraint, schema_regex
from adafuse.tools import forced_call_pattern, forced_call_prefix, parse_tool_calls

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age"]}
PROMPTS = ["The quick brown fox", "Question: who wrote the play Hamlet?\nAnswer:", "In 1969 the first humans"]


class Person(BaseModel):
    name: str
    age: int


def test_automaton_walks_cuts_and_completes():
    automaton = TextAutomaton(r"(yes|no)")
    after_y = automaton.walk("y")
    assert automaton.walk("x") is None and not automaton.accepts(after_y)
    assert automaton.longest_valid_prefix("esterday", after_y) == ("es", automaton.walk("yes"))
    assert automaton.shortest_completion(automaton.initial) == "no" and automaton.shortest_completion(after_y) == "es"
    assert automaton.finished(automaton.walk("no")) and automaton.shortest_completion(automaton.walk("no")) == ""
    digits = TextAutomaton(r"[0-9]+")
    assert digits.accepts(digits.walk("12")) and not digits.finished(digits.walk("12"))


def test_schema_completion_closes_every_prefix_into_valid_json():
    automaton = compile_constraint(PERSON, None)
    text = '{"name": "Ada \\"the\\" Countess", "age": 36, "tags": ["math", "poe'
    for cut in range(len(text) + 1):
        state = automaton.walk(text[:cut])
        assert state is not None, text[:cut]
        value = json.loads(text[:cut] + automaton.shortest_completion(state))
        assert set(value) >= {"name", "age"} and isinstance(value["age"], int)
    assert automaton.walk('{"age": 3') is None  # properties come in the schema's order


def test_bad_constraints_name_the_problem():
    with pytest.raises(ValueError, match="invalid regex"):
        TextAutomaton("(ab")
    with pytest.raises(ValueError, match="accepts no text"):
        TextAutomaton(r"a[^\s\S]b")
    with pytest.raises(ValueError, match="json_schema"):
        schema_regex({"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    with pytest.raises(ValueError, match="not both"):
        FusionConfig(json_schema=PERSON, regex="a").validate()
    with pytest.raises(ValueError, match="word-level fusion"):
        FusionConfig(regex="a+", unit="token").validate()
    with pytest.raises(TypeError, match="json_schema"):
        FusionConfig(json_schema="{}").validate()


@pytest.mark.parametrize("budget", [3, 10, 40])
def test_fused_answers_always_match_the_schema(pair, budget):
    results = pair.generate(PROMPTS, json_schema=PERSON, max_new_tokens=budget)
    for result in results:
        value = json.loads(result.text)
        assert isinstance(value["name"], str) and isinstance(value["age"], int) and result.finish_reason in ("stop", "length")
        assert compile_constraint(PERSON, None).accepts(compile_constraint(PERSON, None).walk(result.text))


def test_constrained_stream_adds_up_to_the_answer(pair):
    pieces = list(pair.stream(PROMPTS[0], regex=r"(yes|no|maybe)( indeed)?", max_new_tokens=6))
    assert "".join(pieces[:-1]) == pieces[-1].text in ("yes", "no", "maybe", "yes indeed", "no indeed", "maybe indeed")


def test_a_constraint_that_allows_everything_changes_nothing(pair):
    free = pair.generate(PROMPTS, max_new_tokens=10)
    allowed = pair.generate(PROMPTS, regex=r"[\s\S]*", max_new_tokens=10)
    assert [r.text for r in allowed] == [r.text for r in free]


def test_forced_tool_calls_are_always_valid(long_pair):
    from adafuse import Chat

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": PERSON}},
             {"type": "function", "function": {"name": "noop"}}]
    assert forced_call_pattern(tools, "auto") is None and forced_call_pattern(tools, "none") is None
    for choice in ("lookup", "required"):
        chat = Chat.with_tools([{"role": "user", "content": "Ada is 36."}], tools, choice)
        for budget in (4, 30):
            result = long_pair.generate(chat, max_new_tokens=budget)
            reply = parse_tool_calls(forced_call_prefix(tools, choice) + result.text)
            assert not reply.invalid_tool_calls and len(reply.tool_calls) == 1
            call = reply.tool_calls[0]
            assert call.name in ("lookup", "noop") and (choice == "required" or call.name == "lookup")
            if call.name == "lookup":
                assert isinstance(call.arguments["name"], str) and isinstance(call.arguments["age"], int)


def test_langchain_structured_output_parses_with_every_method(long_pair):
    pytest.importorskip("langchain_core")
    from adafuse_integrations.langchain import ChatAdaFuse

    chat = ChatAdaFuse(engine=long_pair, max_new_tokens=16)
    for method in ("json_schema", "function_calling"):
        person = chat.with_structured_output(Person, method=method).invoke("Ada is 36.")
        assert isinstance(person, Person)
    out = chat.with_structured_output(PERSON, include_raw=True).invoke("Ada is 36.")
    assert out["parsing_error"] is None and out["parsed"] == json.loads(out["raw"].content)
    assert isinstance(chat.with_structured_output(Person, method="json_mode").invoke("Ada is 36."), dict)
    with pytest.raises(ValueError, match="method"):
        chat.with_structured_output(Person, method="xml")


def test_llama_index_structured_predict_and_structured_llm(long_pair):
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate

    from adafuse_integrations.llama_index import AdaFuseLLM

    llm = AdaFuseLLM(engine=long_pair, max_new_tokens=16)
    assert isinstance(llm.structured_predict(Person, PromptTemplate("Extract: {text}"), text="Ada is 36."), Person)
    reply = llm.as_structured_llm(Person).chat([ChatMessage(role="user", content="Ada is 36.")])
    assert isinstance(reply.raw, Person) and Person.model_validate_json(reply.message.content) == reply.raw
    chat = llm.chat([ChatMessage(role="user", content="Ada is 36.")], json_schema=PERSON)
    assert set(json.loads(chat.message.content)) >= {"name", "age"}
