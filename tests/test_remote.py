"""Served models as ensemble members, over real HTTP on loopback against a vLLM stand-in (tests/fake_vllm.py)."""
from __future__ import annotations

import time

import pytest
import torch
from conftest import _gemma, _llama
from fake_vllm import FakeServer

from adafuse import AdaFuse, BackendError, FusionConfig, RemoteBackend
from adafuse.loading import load_backend

PROMPTS = ["Question: who wrote the play Hamlet?\nAnswer:", "Question: what is the capital of France?\nAnswer:",
           "The quick brown fox"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, byte_level_tokenizer, metaspace_tokenizer):
    """The tiny models' weights, config and tokenizer as transformers folders (what a server is started with)."""
    paths = {}
    for name, model, tokenizer in (("tiny-llama", _llama(byte_level_tokenizer, seed=0), byte_level_tokenizer),
                                   ("tiny-gemma", _gemma(metaspace_tokenizer, seed=1), metaspace_tokenizer)):
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        paths[name] = str(folder)
    return paths


@pytest.fixture(scope="module")
def servers(folders):
    """Stand-in servers, one process each: both tiny models with every log-probability reported, and the llama
    one capped at vLLM's default top 20."""
    started = {"llama": FakeServer(folders["tiny-llama"], "tiny-llama", max_logprobs=1000),
               "gemma": FakeServer(folders["tiny-gemma"], "tiny-gemma", max_logprobs=1000),
               "llama-top20": FakeServer(folders["tiny-llama"], "tiny-llama", max_logprobs=20)}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture()
def llama_server(servers):
    server = servers["llama"]
    yield server
    server.fault(fail_next=0, hang_s=0.0, die_after=None)


def _remote(server: FakeServer, folders, name: str = "tiny-llama", **options) -> RemoteBackend:
    return RemoteBackend(server.url, server.name, tokenizer=folders[name], **options)


def test_served_member_decodes_as_the_same_model_in_process(folders, llama_server, llama_backend, gemma_backend):
    config = FusionConfig(max_new_tokens=12)
    local = AdaFuse([llama_backend, gemma_backend], config).generate(PROMPTS, trace=True)
    with AdaFuse([_remote(llama_server, folders, top_k=1000), gemma_backend], config) as mixed:
        served = mixed.generate(PROMPTS, trace=True)
        assert mixed.backends[0].name == f"tiny-llama@{llama_server.url}"
    assert [r.text for r in served] == [r.text for r in local]
    for ours, theirs in zip(served, local):
        for a, b in zip(ours.trace, theirs.trace):
            assert [c.score for c in a.candidates] == pytest.approx([c.score for c in b.candidates], abs=1e-3)
        assert ours.stats.requests[f"tiny-llama@{llama_server.url}"] > 0
        assert list(ours.stats.model_weights.values()) == pytest.approx(list(theirs.stats.model_weights.values()), abs=1e-4)


def test_both_members_served_equal_both_in_process(folders, servers, llama_backend, gemma_backend):
    pair = [servers["llama"], servers["gemma"]]
    config = FusionConfig(max_new_tokens=10)
    backends = [RemoteBackend(s.url, s.name, tokenizer=folders[s.name], top_k=1000, name=f"vllm:{s.url}#{s.name}") for s in pair]
    with AdaFuse(backends, config) as served:
        texts = [r.text for r in served.generate(PROMPTS)]
    assert texts == [r.text for r in AdaFuse([llama_backend, gemma_backend], config).generate(PROMPTS)]
    assert pair[0].stats()["max_in_flight"] > 1, "one step's requests to a server should go out side by side"


def test_tokens_outside_the_reported_top_k_are_scored_exactly(folders, servers, llama_backend):
    remote = _remote(servers["llama-top20"], folders)
    assert remote.max_top_k == 20
    texts = ["Paris is the capital", " zebra quantum 1969"]
    local_scores = AdaFuse([llama_backend]).score(PROMPTS[1], texts)
    with AdaFuse([remote]) as fused:
        scores = fused.score(PROMPTS[1], texts)
        assert [s for row in scores for s in row] == pytest.approx([s for row in local_scores for s in row], abs=1e-4)
        assert remote.counters["requests"] > remote.counters["tokens"], "unlisted tokens need requests of their own"


def test_top_k_beyond_the_server_limit_is_refused_by_name(folders, servers, llama_server, gemma_backend):
    with AdaFuse([_remote(llama_server, folders, top_k=5), gemma_backend]) as fused:
        with pytest.raises(ValueError, match="num_branches=8.*top 5"):
            fused.generate(PROMPTS[0], num_branches=8)
    with AdaFuse([_remote(servers["llama-top20"], folders, top_k=50)]) as fused:
        with pytest.raises(BackendError, match="HTTP 400.*greater than max allowed: 20"):
            fused.generate(PROMPTS[0])


def test_a_server_with_another_tokenizer_is_refused(folders, llama_server):
    with pytest.raises(BackendError, match="tokenizes differently"):
        RemoteBackend(llama_server.url, llama_server.name, tokenizer=folders["tiny-gemma"])


def test_unreachable_server_and_unknown_model_name_the_problem(folders, llama_server):
    started = time.perf_counter()
    with pytest.raises(BackendError, match=r"127\.0\.0\.1:9.*connection failed"):
        RemoteBackend("http://127.0.0.1:9/v1", "tiny-llama", tokenizer=folders["tiny-llama"], retries=1)
    assert time.perf_counter() - started < 10
    with pytest.raises(BackendError, match=r"does not serve 'other'.*tiny-llama"):
        RemoteBackend(llama_server.url, "other", tokenizer=folders["tiny-llama"])


def test_transient_failures_are_retried_and_hung_requests_time_out(folders, llama_server, gemma_backend):
    remote = _remote(llama_server, folders, top_k=1000, timeout=1.0, retries=2)
    with AdaFuse([remote, gemma_backend], FusionConfig(max_new_tokens=6)) as fused:
        expected = fused.generate(PROMPTS[0]).text
        llama_server.fault(fail_next=2)
        assert fused.generate(PROMPTS[0]).text == expected
        llama_server.fault(hang_s=3.0)
        started = time.perf_counter()
        with pytest.raises(BackendError, match="timed out after 3 attempt"):
            fused.generate(PROMPTS[0])
        assert time.perf_counter() - started < 8
        llama_server.fault(hang_s=0.0)
        assert fused.generate(PROMPTS[0]).text == expected


def test_server_lost_mid_answer_raises_and_the_engine_recovers(folders, llama_server, gemma_backend):
    remote = _remote(llama_server, folders, top_k=1000, retries=1)
    with AdaFuse([remote, gemma_backend], FusionConfig(max_new_tokens=12)) as fused:
        expected = fused.generate(PROMPTS[1]).text
        llama_server.fault(die_after=llama_server.stats()["completions"] + 5)
        with pytest.raises(BackendError, match="connection failed"):
            fused.generate(PROMPTS[1])
        llama_server.start()
        assert fused.generate(PROMPTS[1]).text == expected


def test_policies_that_read_hidden_states_refuse_served_models(folders, llama_server, gemma_backend):
    remote = _remote(llama_server, folders)
    assert remote.hidden_size is None
    with pytest.raises(ValueError, match="cannot return hidden states"):
        remote.start([[1, 2, 3]], keep_hidden=True)
    remote.close()


def test_remote_specs(folders, llama_server, monkeypatch):
    monkeypatch.setattr("adafuse.models.resolve_model", lambda name: folders["tiny-llama"] if name == "tiny-llama" else name)
    spec = f"vllm:{llama_server.url}#tiny-llama"
    backend = load_backend(spec)
    assert isinstance(backend, RemoteBackend) and backend.name == spec and backend.served_name == "tiny-llama"
    backend.close()
    with pytest.raises(ValueError, match="served-model-name"):
        load_backend(f"vllm:{llama_server.url}")
    with pytest.raises(TypeError, match="non-empty string"):
        load_backend("")
    with pytest.raises(BackendError, match="closed"):
        backend.next_tokens([[1, 2]])
