"""The OpenAI-compatible server over real HTTP on loopback, with the openai client, LangChain's ChatOpenAI and
LlamaIndex's OpenAILike as clients."""
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from adafuse.server import create_app  # noqa: E402

MODEL = "tiny-fused"
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
PROMPTS = ["The quick brown fox", "Question: who wrote the play Hamlet?\nAnswer:", "In 1969 the first humans",
           "Paris is", "Once upon a time", "Adaptive ensemble decoding", "The river bank", "Question: what is"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _serving(app):
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def url(long_pair):
    with _serving(create_app(long_pair, model_name=MODEL, max_tokens=8)) as address:
        yield address


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_health_and_models(url):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    [model] = httpx.get(url + "/v1/models").json()["data"]
    assert model["id"] == MODEL and model["members"] == ["tiny-llama", "tiny-gemma"]


def test_completion_equals_the_engine(client, long_pair):
    expected = long_pair.generate(PROMPTS[0], max_new_tokens=8)
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8)
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == expected.stats.new_tokens
    assert reply.usage.prompt_tokens == expected.stats.prompt_tokens["tiny-llama"]
    both = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, extra_body={"tau_delta": 1.0})
    assert [c.text for c in both.choices] == [long_pair.generate(p, max_new_tokens=8, tau_delta=1.0).text for p in PROMPTS[:2]]


def test_chat_completion_and_its_stream(client, long_pair):
    expected = long_pair.generate(QUESTION, max_new_tokens=8).text
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    assert reply.choices[0].message.content == expected and reply.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason


def test_tools_and_response_format(client):
    forced = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                            max_tokens=12)
    [call] = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    shaped = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, response_format={
        "type": "json_schema", "json_schema": {"name": "reply", "schema": schema}})
    assert isinstance(json.loads(shaped.choices[0].message.content)["answer"], str)


def test_concurrent_clients_each_get_the_answer_alone(url, long_pair):
    alone = [long_pair.generate(p, max_new_tokens=4 + i % 3).text for i, p in enumerate(PROMPTS)]
    answers = [None] * len(PROMPTS)

    def ask(i):
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 4 + i % 3}
        answers[i] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [a["choices"][0]["text"] for a in answers] == alone
    assert max(a["adafuse"][0]["batch_size"] for a in answers) > 1


def test_bad_requests_name_the_problem(url):
    bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.post(url + "/v1/chat/completions", json={"model": MODEL})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "messages"
    empty = httpx.post(url + "/v1/completions", json={"prompt": "   "})
    assert empty.status_code == 400 and "prompt is empty" in empty.json()["error"]["message"]
    second_empty = httpx.post(url + "/v1/completions", json={"prompt": [PROMPTS[0], " "], "max_tokens": 4}, timeout=60)
    assert second_empty.status_code == 400 and "prompt is empty" in second_empty.json()["error"]["message"]
    unknown = httpx.post(url + "/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    too_long = httpx.post(url + "/v1/completions", json={"prompt": "word " * 3000})
    assert too_long.status_code == 400 and "context window" in too_long.json()["error"]["message"]
    not_json = httpx.post(url + "/v1/completions", content=b"{bad json", headers={"content-type": "application/json"})
    assert not_json.status_code == 422 and "not valid JSON" in not_json.json()["error"]["message"]
    form = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert form.status_code == 422 and "Content-Type: application/json" in form.json()["error"]["message"]
    bad_option = httpx.post(url + "/v1/completions", json={"prompt": "x", "tau_delta": 3})
    assert bad_option.status_code == 400 and bad_option.json()["error"]["param"] == "tau_delta"
    bad_choice = httpx.post(url + "/v1/chat/completions", json={"messages": QUESTION, "tools": [WEATHER], "tool_choice": "nope"})
    assert bad_choice.status_code == 400 and "nope" in bad_choice.json()["error"]["message"]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(url, long_pair):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 300, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    time.sleep(0.5)
    short = httpx.post(url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 3}, timeout=60).json()
    assert short["adafuse"][0]["batch_size"] == 1
    assert short["choices"][0]["text"] == long_pair.generate(PROMPTS[3], max_new_tokens=3).text


def test_a_full_server_answers_429(long_pair):
    with _serving(create_app(long_pair, model_name=MODEL, max_pending=1)) as address:
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "stream": True}
        with httpx.stream("POST", address + "/v1/completions", json=body, timeout=60) as first:
            lines = first.iter_lines()
            next(lines)
            busy = httpx.post(address + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2})
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        time.sleep(0.5)
        assert httpx.post(address + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 2}, timeout=60).status_code == 200


def test_framework_openai_clients_use_the_server(url, long_pair):
    langchain_openai = pytest.importorskip("langchain_openai")
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    expected = long_pair.generate(QUESTION, max_new_tokens=8).text
    chat = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key="unused", model=MODEL, max_tokens=8, max_retries=0)
    assert chat.invoke("What is the weather in Paris?").content == expected
    llm = openai_like.OpenAILike(api_base=url + "/v1", api_key="unused", model=MODEL, max_tokens=8, is_chat_model=True,
                                 context_window=2048)
    assert llm.chat([ChatMessage(role="user", content="What is the weather in Paris?")]).message.content == expected


def test_shutdown_lets_requests_in_flight_finish(long_pair):
    lines, started = [], threading.Event()

    def read(address):
        body = {"prompt": PROMPTS[0], "max_tokens": 60, "stream": True}
        with httpx.stream("POST", address + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()

    with _serving(create_app(long_pair, model_name=MODEL)) as address:
        reader = threading.Thread(target=read, args=(address,), daemon=True)
        reader.start()
        assert started.wait(30)
    reader.join(timeout=60)  # leaving _serving asked the server to exit and waited for it
    assert "data: [DONE]" in lines
