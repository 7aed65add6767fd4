"""LangChain and LlamaIndex adapters over tiny models: they translate calls, the engine decodes."""
import asyncio

import pytest
import torch

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402

from adafuse_integrations.langchain import AdaFuseLLM as LangChainLLM  # noqa: E402
from adafuse_integrations.llama_index import AdaFuseLLM as LlamaIndexLLM  # noqa: E402

PROMPT = "Question: what is the capital of France?\nAnswer:"


@pytest.fixture()
def lc_llm(pair):
    return LangChainLLM(engine=pair, max_new_tokens=8)


@pytest.fixture()
def li_llm(pair):
    return LlamaIndexLLM(engine=pair, max_new_tokens=8)


class _Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens = []

    def on_llm_new_token(self, token, **kwargs):
        self.tokens.append(token)


def test_langchain_invoke_matches_engine(lc_llm, pair):
    assert lc_llm.invoke(PROMPT) == pair.generate(PROMPT, max_new_tokens=8).text
    assert lc_llm._llm_type == "adafuse"
    assert lc_llm._identifying_params["models"] == ["tiny-llama", "tiny-gemma"]


def test_langchain_generation_info_and_batch(lc_llm):
    result = lc_llm.generate([PROMPT, "The quick brown fox"])
    assert len(result.generations) == 2
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] in ("eos", "stop", "length") and info["rounds"] >= 1
    assert set(info["forward_passes"]) == {"tiny-llama", "tiny-gemma"}
    assert lc_llm.batch([PROMPT, "The quick brown fox"]) == [g[0].text for g in result.generations]


def test_langchain_stop_and_per_call_overrides(lc_llm, pair):
    free = lc_llm.invoke(PROMPT)
    stop = free[2:4]
    assert lc_llm.invoke(PROMPT, stop=[stop]) == free[: free.find(stop)]
    assert lc_llm.invoke(PROMPT, tau_delta=1.0, num_branches=1) == pair.generate(PROMPT, max_new_tokens=8, tau_delta=1.0, num_branches=1).text


def test_langchain_stream_and_callbacks(lc_llm):
    handler = _Tokens()
    chunks = list(lc_llm.stream(PROMPT, config={"callbacks": [handler]}))
    assert "".join(chunks) == lc_llm.invoke(PROMPT)
    assert len([c for c in chunks if c]) > 1
    assert "".join(handler.tokens) == "".join(chunks)


def test_langchain_async(lc_llm):
    async def run():
        text = await lc_llm.ainvoke(PROMPT)
        pieces = [c async for c in lc_llm.astream(PROMPT)]
        return text, "".join(pieces)

    text, streamed = asyncio.run(run())
    assert text == streamed == lc_llm.invoke(PROMPT)


def test_langchain_lcel_rag_chain_with_fake_retriever(lc_llm):
    documents = {"france": "Paris is the capital of France."}
    retrieve = RunnableLambda(lambda q: documents["france"])
    prompt = PromptTemplate.from_template("Context: {context}\nQuestion: {question}\nAnswer:")
    chain = {"context": retrieve, "question": RunnableLambda(lambda q: q)} | prompt | lc_llm | StrOutputParser()
    answer = chain.invoke("what is the capital of France?")
    expected = lc_llm.invoke("Context: Paris is the capital of France.\nQuestion: what is the capital of France?\nAnswer:")
    assert answer == expected


def test_langchain_bad_input_errors(lc_llm, pair):
    with pytest.raises(ValueError, match="prompt is empty"):
        lc_llm.invoke("  ")
    with pytest.raises(ValueError, match="unknown decoding parameter"):
        lc_llm.invoke(PROMPT, temprature=2)
    with pytest.raises(ValueError, match="tau_delta"):
        LangChainLLM(engine=pair, tau_delta=2.0)


def test_llama_index_complete_and_metadata(li_llm, pair):
    response = li_llm.complete(PROMPT)
    assert response.text == pair.generate(PROMPT, max_new_tokens=8).text
    assert response.additional_kwargs["rounds"] >= 1
    meta = li_llm.metadata
    assert meta.context_window == 256  # the smaller of the two tiny models' windows
    assert meta.num_output == 8 and meta.model_name == "adafuse(tiny-llama+tiny-gemma)" and meta.is_chat_model


def test_llama_index_stream_complete_deltas(li_llm):
    responses = list(li_llm.stream_complete(PROMPT))
    assert "".join(r.delta for r in responses) == responses[-1].text == li_llm.complete(PROMPT).text
    assert responses[-1].additional_kwargs["finish_reason"] in ("eos", "stop", "length")


def test_llama_index_chat_and_async(li_llm):
    reply = li_llm.chat([ChatMessage(role="user", content="what is the capital of France?")])
    assert reply.message.role == "assistant" and isinstance(reply.message.content, str)

    async def run():
        done = await li_llm.acomplete(PROMPT)
        stream = await li_llm.astream_complete(PROMPT)
        return done.text, [r async for r in stream][-1].text

    text, streamed = asyncio.run(run())
    assert text == streamed == li_llm.complete(PROMPT).text


def test_llama_index_bad_input_errors(li_llm, pair):
    with pytest.raises(ValueError, match="prompt is empty"):
        li_llm.complete(" ")
    with pytest.raises(ValueError, match="num_branches"):
        LlamaIndexLLM(engine=pair, num_branches=0)


def test_learned_fusion_gate_is_a_decoding_option_in_both_frameworks(pair, tmp_path):
    from adafuse.fusion.gate import FusionGate

    gate = FusionGate([b.model.config.get_text_config().hidden_size for b in pair.backends], pair.model_names)
    with torch.no_grad():  # a gate that always commits decodes like tau_delta=0
        gate.policy[-1].weight.zero_()
        gate.policy[-1].bias.copy_(torch.tensor([-10.0, 10.0]))
    folder = str(gate.save(tmp_path / "gate"))
    expected = pair.generate(PROMPT, tau_delta=0.0, max_new_tokens=8).text
    assert LangChainLLM(engine=pair, max_new_tokens=8, fusion_gate=folder).invoke(PROMPT) == expected
    assert LangChainLLM(engine=pair, max_new_tokens=8).invoke(PROMPT, fusion_gate=folder) == expected
    assert LlamaIndexLLM(engine=pair, max_new_tokens=8, fusion_gate=folder).complete(PROMPT).text == expected
    with pytest.raises(FileNotFoundError, match="no fusion gate"):
        LlamaIndexLLM(engine=pair, fusion_gate=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no fusion gate"):
        LangChainLLM(engine=pair, fusion_gate=str(tmp_path / "missing"))


def test_decoding_adapters_are_options_in_both_frameworks(pair, tmp_path):
    from adafuse import SequenceAdapter
    from adafuse import SamplingFilter

    backend = pair.backends[0]
    sequence = SequenceAdapter(backend.model.config.hidden_size, [SamplingFilter()], hidden=8, base_model=backend.name)
    folder = str(sequence.save(tmp_path / "sequence"))
    expected = pair.generate(PROMPT, sequence_adapter=folder, num_samples=2, max_new_tokens=8).text
    lc = LangChainLLM(engine=pair, max_new_tokens=8, sequence_adapter=folder, num_samples=2)
    assert lc.invoke(PROMPT) == expected
    assert LangChainLLM(engine=pair, max_new_tokens=8).invoke(PROMPT, sequence_adapter=folder, num_samples=2) == expected
    info = lc.generate([PROMPT]).generations[0][0].generation_info
    assert set(info["forward_passes"]) == {backend.name}
    assert LlamaIndexLLM(engine=pair, max_new_tokens=8, sequence_adapter=folder).complete(PROMPT).text == expected
    with pytest.raises(FileNotFoundError, match="no sequence adapter"):
        LlamaIndexLLM(engine=pair, sequence_adapter=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="num_samples"):
        LangChainLLM(engine=pair, num_samples=3)
