"""Regression tests for what a hostile or careless caller can do: hangs, silent garbage, code execution, lost work."""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from adafuse import AdaFuse, FusionConfig
from adafuse.sampling.policies import TokenAdapter
from adafuse.training.reinforce import load_checkpoint, save_checkpoint
from adafuse.files import append_jsonl, read_jsonl, write_text_atomically
from adafuse.runtime import ModelRunner

PROMPT = "Question: who wrote the play Hamlet?\nAnswer:"


def _finishes(call, timeout: float = 60.0):
    """Run `call` in a thread; fail (instead of hanging the suite) when it does not return within `timeout`."""
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.setdefault("value", call()), daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), f"{call} did not return within {timeout} s"
    return outcome["value"]


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# ---------------------------------------------------------------------------------------------------- hangs
def test_a_half_read_stream_does_not_block_the_engine(pair):
    expected = pair.generate(PROMPT, max_new_tokens=6).text
    stream = pair.stream(PROMPT, max_new_tokens=40)
    next(stream)
    assert _finishes(lambda: pair.generate(PROMPT, max_new_tokens=6)).text == expected
    rest = list(stream)
    assert rest and rest[-1].finish_reason in ("length", "eos", "stop")


def test_closing_a_stream_cancels_its_decode(pair):
    stream = pair.stream(PROMPT, max_new_tokens=200, stop=["never appears"])
    next(stream)
    stream.close()
    assert _wait_until(lambda: not _threads_named("adafuse-stream"))
    assert _finishes(lambda: pair.generate(PROMPT, max_new_tokens=4)).text


def test_framework_streams_read_halfway_do_not_block(pair):
    from adafuse_integrations.langchain import AdaFuseLLM
    from adafuse_integrations.llama_index import AdaFuseLLM as AdaFuseLlamaIndexLLM

    langchain, llama_index = AdaFuseLLM(engine=pair, max_new_tokens=30), AdaFuseLlamaIndexLLM(engine=pair, max_new_tokens=30)
    chunks, responses = langchain.stream(PROMPT), llama_index.stream_complete(PROMPT)
    next(chunks)
    next(responses)
    assert isinstance(_finishes(lambda: langchain.invoke(PROMPT, max_new_tokens=4)), str)
    assert _finishes(lambda: llama_index.complete(PROMPT, max_new_tokens=4)).text is not None


def test_an_abandoned_astream_stops_generating(pair):
    from adafuse_integrations.langchain import AdaFuseLLM

    llm = AdaFuseLLM(engine=pair, max_new_tokens=200, stop=["never appears"])

    async def first_chunk() -> str:
        async for chunk in llm.astream(PROMPT):
            return chunk

    assert isinstance(asyncio.run(first_chunk()), str)
    assert _wait_until(lambda: not _threads_named("adafuse-astream") and not _threads_named("adafuse-stream"))


# ---------------------------------------------------------------------------------------------- wrong output
def test_a_single_message_dict_is_one_prompt(pair):
    message = {"role": "user", "content": "who wrote Hamlet?"}
    result = pair.generate(message, max_new_tokens=4)
    assert not isinstance(result, list)
    assert result.text == pair.generate([message], max_new_tokens=4).text


@pytest.mark.parametrize("weights", [[float("nan"), 1.0], [float("inf"), 1.0], [1.0, -1.0]])
def test_non_finite_model_weights_are_refused(pair, weights):
    with pytest.raises(ValueError, match="model_weights"):
        pair.generate(PROMPT, model_weights=weights)


def test_cli_escapes_keep_non_ascii_text():
    from adafuse.cli import _unescape

    assert _unescape("Café") == "Café"
    assert _unescape("🙂\\n") == "🙂\n"
    assert _unescape("a\\tb\\u00e9") == "a\tbé"


def test_cli_reads_stdin_as_utf8_and_names_bad_bytes(monkeypatch):
    import io

    from adafuse.cli import _read_stdin

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("Café 🙂".encode())))
    assert _read_stdin() == "Café 🙂"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"abc\xff")))
    with pytest.raises(ValueError, match="not UTF-8.*0xff"):
        _read_stdin()


def test_cutting_at_the_token_budget_never_splits_a_character(pair):
    text = "Answer: é😀 and more"
    ids = pair.backends[0].encode_piece(text)
    for budget in range(1, len(ids)):
        cut = pair.backends[0].truncate(text, budget)
        assert "\ufffd" not in cut and text.startswith(cut)


def test_a_cut_stays_within_the_budget_when_the_text_holds_a_replacement_character(pair):
    """U+FFFD in the text (a decoded partial byte) takes several byte tokens: a cut among them must back off."""
    counter = pair.backends[0]
    text = " Francez\ufffd"
    ids = counter.encode_piece(text)
    assert len(ids) > len(counter.encode_piece(" Francez")) + 1
    for budget in range(1, len(ids)):
        cut = counter.truncate(text, budget)
        assert len(counter.encode_piece(cut)) <= budget and text.startswith(cut)


def test_decoding_stays_inside_every_context_window(llama_backend, gemma_backend, monkeypatch):
    """The budget check at the start counts the first model's tokens only; exploration goes deeper still."""
    fuser = AdaFuse([llama_backend, gemma_backend],
                    FusionConfig(tau_delta=1.0, max_span_words=2, max_word_tokens=4, stop=["never appears"]))
    sentence, prompt = "The quick brown fox jumps over the lazy dog. ", ""
    while len(llama_backend.encode_prompt(prompt + sentence)) < llama_backend.context_window - 24:
        prompt += sentence
    budget = llama_backend.context_window - len(llama_backend.encode_prompt(prompt))
    deepest = {}
    run = ModelRunner.run

    def recording(self, cache, input_ids, mask, positions, *args, **kwargs):
        deepest[id(self.model)] = max(deepest.get(id(self.model), 0), int(positions.max()))
        return run(self, cache, input_ids, mask, positions, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "run", recording)
    result = fuser.generate(prompt, max_new_tokens=budget)
    assert result.finish_reason in ("length", "eos")
    for backend in fuser.backends:
        assert deepest[id(backend.model)] < backend.context_window, backend.name


# ---------------------------------------------------------------------------------------------- code execution
class _Planted:
    def __reduce__(self):
        return (Path.touch, (Path(_Planted.marker),))


def test_a_planted_checkpoint_runs_no_code(tmp_path):
    _Planted.marker = str(tmp_path / "code-ran")
    planted = tmp_path / "checkpoint.safetensors"
    planted.write_bytes(pickle.dumps({"policy": _Planted()}))
    adapter = TokenAdapter(8, projection=4, hidden=4)
    with pytest.raises(ValueError, match="checkpoint"):
        load_checkpoint(planted, adapter, torch.optim.Adam(adapter.parameters()))
    assert not Path(_Planted.marker).exists()


def test_checkpoints_round_trip_policy_and_optimizer(tmp_path):
    adapter = TokenAdapter(8, projection=4, hidden=4)
    optimizer = torch.optim.Adam(adapter.parameters(), lr=0.01)
    loss = adapter.policy(torch.randn(2, 4 + 3)).sum()
    loss.backward()
    optimizer.step()
    history = [{"step": 1, "loss": 0.5}]
    save_checkpoint(tmp_path / "c.safetensors", adapter, optimizer, 1, history)
    fresh = TokenAdapter(8, projection=4, hidden=4)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.01)
    assert load_checkpoint(tmp_path / "c.safetensors", fresh, fresh_optimizer) == (1, history)
    assert all(torch.equal(a, b) for a, b in zip(adapter.state_dict().values(), fresh.state_dict().values()))
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k]["exp_avg"], loaded[k]["exp_avg"]) for k in saved)


# ---------------------------------------------------------------------------------------------- lost work
def test_a_run_killed_mid_write_resumes(tmp_path):
    path = tmp_path / "predictions.jsonl"
    append_jsonl(path, [{"index": 0}, {"index": 1}])
    with open(path, "a") as handle:
        handle.write('{"index": 2, "compl')  # the process died here
    assert [r["index"] for r in read_jsonl(path)] == [0, 1]
    append_jsonl(path, [{"index": 2}])
    assert [r["index"] for r in read_jsonl(path)] == [0, 1, 2]
    assert path.read_text().count("\n") == 3


def test_a_damaged_line_is_named(tmp_path):
    path = tmp_path / "predictions.jsonl"
    path.write_text('{"index": 0}\nnot json\n{"index": 2}\n')
    with pytest.raises(ValueError, match=r"predictions.jsonl, line 2"):
        read_jsonl(path)


def test_atomic_writes_leave_the_old_file_when_the_writer_fails(tmp_path):
    from adafuse.files import write_atomically

    path = write_text_atomically(tmp_path / "report.md", "old")

    def fail(temporary: Path) -> None:
        temporary.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(path, fail)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


# ---------------------------------------------------------------------------------------------- errors that name the problem
@pytest.mark.parametrize(("prompt", "error", "pattern"), [
    (None, TypeError, "NoneType"),
    (5, TypeError, "int"),
    (b"bytes", TypeError, "decode"),
    ("\ud800 lone", ValueError, "surrogate"),
    ([{"role": "user", "content": None}], TypeError, "content"),
    ([{"role": "user", "content": 3}], TypeError, "content"),
    ([{"role": "wizard", "content": "hi"}], ValueError, "role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], ValueError, "text content"),
    ([], ValueError, "empty"),
])
def test_bad_prompts_are_named(pair, prompt, error, pattern):
    with pytest.raises(error, match=pattern):
        pair.generate(prompt)


def test_text_content_parts_are_joined(pair):
    parts = [{"role": "user", "content": [{"type": "text", "text": "who wrote "}, {"type": "text", "text": "Hamlet?"}]}]
    plain = [{"role": "user", "content": "who wrote Hamlet?"}]
    assert pair.generate(parts, max_new_tokens=4).text == pair.generate(plain, max_new_tokens=4).text


@pytest.mark.parametrize(("overrides", "error", "field"), [
    ({"stop": 5}, TypeError, "stop"),
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens"),
    ({"max_new_tokens": True}, TypeError, "max_new_tokens"),
    ({"seed": 2**70}, ValueError, "seed"),
    ({"tau_delta": "0.5"}, TypeError, "tau_delta"),
    ({"num_branches": 10**6}, ValueError, "num_branches"),
    ({"token_top_k": 10**6}, ValueError, "token_top_k"),
])
def test_bad_parameters_are_named_before_decoding(pair, overrides, error, field):
    with pytest.raises(error, match=field):
        pair.generate(PROMPT, **overrides)


@pytest.mark.parametrize("config", ["not json", json.dumps({"hidden_size": 8}), json.dumps({"kind": "token", "hidden_size": 8})])
def test_corrupt_adapter_folders_name_the_folder(tmp_path, config):
    (tmp_path / "adapter_config.json").write_text(config)
    with pytest.raises(ValueError, match=str(tmp_path)):
        TokenAdapter.load(tmp_path)


def test_langchain_batch_fails_only_the_bad_prompt(pair):
    from adafuse_integrations.langchain import AdaFuseLLM

    llm = AdaFuseLLM(engine=pair, max_new_tokens=4)
    outputs = llm.batch([PROMPT, "   ", "The quick brown fox"], return_exceptions=True)
    assert isinstance(outputs[1], ValueError) and "empty" in str(outputs[1])
    assert outputs[0] == llm.invoke(PROMPT) and outputs[2] == llm.invoke("The quick brown fox")


def test_cli_ctrl_c_prints_one_line_and_exits_130(monkeypatch, capsys):
    from adafuse import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_models", interrupted)
    assert cli.main(["models"]) == 130
    assert capsys.readouterr().err.strip() == "adafuse: interrupted"


def test_openmp_spinning_is_bounded_only_when_nobody_chose(monkeypatch):
    from adafuse import _threads

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert not _threads.bound_openmp_spinning()  # torch is loaded: too late to matter, so nothing is set
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not _threads.bound_openmp_spinning() and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert _threads.bound_openmp_spinning() and os.environ["GOMP_SPINCOUNT"] == _threads.SPIN_COUNT
