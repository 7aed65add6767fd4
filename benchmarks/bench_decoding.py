"""Speed of the AdaFuse engine against a naive reference of the same algorithm and single-model decoding.

    python benchmarks/bench_decoding.py --limit 20
    python benchmarks/bench_decoding.py --bench squad --limit 16 --skip-naive   # long, distinct contexts

Runs on the embedded default pair over the first N dev questions of a QA benchmark (NQ by default: a shared
few-shot prompt, stop at newline; SQuAD: a context per question, the benchmark's stop sequences) and prints,
per method: wall time per answer, tokens per second, forward passes and tokens processed per model,
peak resident memory, and answer agreement; then the ratio figures of the performance targets.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from adafuse import AdaFuse, FusionConfig, GenerationResult
from adafuse.eval.benchmarks import BENCHMARKS, benchmark_root
from adafuse.runtime import PromptPrefixCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from naive_adafuse import NaiveAdaFuse  # noqa: E402



def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


DATA = os.environ.get("ADAFUSE_DATA", str(Path("..") / "shared" / "benchmarks"))


def load_prompts(limit: int, bench: str = "nq", data: str = DATA) -> tuple[list[str], list[str]]:
    """The first `limit` prompts of a QA benchmark and the stop sequences to decode them with."""
    benchmark = BENCHMARKS[bench]
    few_shot, rows = benchmark.load(benchmark_root(data), limit)
    stop = ["\n"] if bench == "nq" else list(benchmark.stop)
    return [benchmark.prompt(few_shot, row["question"]) for row in rows.values()], stop


def counters(fuser: AdaFuse) -> dict[str, dict[str, int]]:
    return {b.name: b.reset_counters() for b in fuser.backends}


def report(name: str, seconds: list[float], tokens: list[int], work: dict[str, dict[str, int]], answers: int) -> None:
    per_answer = sum(seconds) / answers
    rate = sum(tokens) / sum(seconds) if sum(seconds) else 0.0
    per_model = "  ".join(f"{m}: {w['forward_passes'] / answers:.1f} fwd, {w['tokens'] / answers:.0f} tok" for m, w in work.items())
    print(f"{name:<28} {per_answer:7.3f} s/answer  {rate:6.1f} tok/s  per answer [{per_model}]  peak RSS {peak_rss_mb():.0f} MB")


def prime_prefix_caches(fuser: AdaFuse, primer: str) -> None:
    """Fresh prompt caches holding only `primer` (another question of the benchmark), encoded as the engine encodes
    prompts (with the prompt-token NLLs competence scoring reads), so every timed run starts as a server that has
    seen the prompt template, not these prompts."""
    for backend in fuser.backends:
        backend.prefix_cache = PromptPrefixCache()
    fuser.generate(primer, max_new_tokens=1)


class BatchTimings(NamedTuple):
    """Wall times of the interleaved runs of a set of prompts decoded one at a time and together, and the last
    run's results of both."""

    alone_runs: list[float]
    batch_runs: list[float]
    batched: list[GenerationResult]
    alone: list[GenerationResult]


def batch_against_alone(fuser: AdaFuse, prompts: list[str], primer: str | None, repeats: int,
                        max_batch_size: int | None = None) -> BatchTimings:
    """Decode `prompts` one at a time and together (at most `max_batch_size` in flight), interleaved `repeats`
    times so that drift in the machine's speed hits both alike. Every run starts from prompt caches holding only
    `primer` (None: no prompt-prefix reuse at all).

    One untimed batch run comes first: the single-prompt runs before this have already warmed what a first call
    of each shape costs (oneDNN kernels built for a new row count, the heap grown to a step's size), and a batch
    has shapes of its own."""
    def fresh_caches() -> None:
        if primer is None:
            for backend in fuser.backends:
                backend.prefix_cache = None
        else:
            prime_prefix_caches(fuser, primer)

    fresh_caches()
    fuser.generate(prompts, max_batch_size=max_batch_size)
    alone_runs, batch_runs = [], []
    for _ in range(repeats):
        fresh_caches()
        started = time.perf_counter()
        alone = [fuser.generate(prompt) for prompt in prompts]
        alone_runs.append(time.perf_counter() - started)
        fresh_caches()
        started = time.perf_counter()
        batched = fuser.generate(prompts, max_batch_size=max_batch_size)
        batch_runs.append(time.perf_counter() - started)
    return BatchTimings(alone_runs, batch_runs, batched, alone)


def print_throughput(label: str, measured: BatchTimings) -> None:
    """One throughput figure: the ratio of the median times, the ratio of the fastest runs (the least disturbed
    by other work on the machine, as `timeit` advises) and every run's ratio."""
    alone_runs, batch_runs, batched, alone = measured
    count = len(alone)
    alone_time, batch_time = statistics.median(alone_runs), statistics.median(batch_runs)
    print(f"  {label}: {batch_time / count:.3f} s/answer vs {alone_time / count:.3f} alone -> throughput "
          f"x{alone_time / batch_time:.2f} (medians of {len(alone_runs)} interleaved runs; fastest runs "
          f"x{min(alone_runs) / min(batch_runs):.2f}; each run x{', x'.join(f'{a / b:.2f}' for a, b in zip(alone_runs, batch_runs))}); "
          f"answers equal alone: {sum(r.text == a.text for r, a in zip(batched, alone)) / count:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default="nq", choices=["nq", "squad", "triviaqa"])
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved runs of the batch and of its prompts alone")
    args = parser.parse_args()
    torch.manual_seed(0)
    prompts, stop = load_prompts(args.limit + 1, args.bench)
    prompts, primer = prompts[:-1], prompts[-1]  # the primer only warms prompt caches for the batch figures
    config = FusionConfig(max_new_tokens=args.max_new_tokens, stop=stop)
    fuser = AdaFuse.from_pretrained(config=config)
    fuser.generate(prompts[0])  # warm-up

    print(f"{len(prompts)} {args.bench} questions, max_new_tokens={args.max_new_tokens}, threads={torch.get_num_threads()}")
    def run_engine(label: str, reuse_prefix: bool) -> tuple[list[str], list[float], list[int]]:
        for backend in fuser.backends:
            backend.prefix_cache = PromptPrefixCache() if reuse_prefix else None
        texts, seconds, tokens = [], [], []
        work = {name: {"forward_passes": 0, "tokens": 0} for name in fuser.model_names}
        for prompt in tqdm(prompts, desc=label):
            result = fuser.generate(prompt)
            texts.append(result.text)
            seconds.append(result.stats.wall_time_s)
            tokens.append(result.stats.new_tokens)
            for name in work:
                work[name]["forward_passes"] += result.stats.forward_passes[name]
                work[name]["tokens"] += result.stats.tokens_processed[name]
        report(label, seconds, tokens, work, len(prompts))
        return texts, seconds, tokens

    cold, cold_seconds, _ = run_engine("adafuse, no prefix reuse", reuse_prefix=False)
    fused, fused_seconds, fused_tokens = run_engine("adafuse (engine)", reuse_prefix=True)

    naive_time = None
    if not args.skip_naive:
        naive = NaiveAdaFuse(fuser.backends, config)
        naive_answers, naive_seconds = [], []
        for prompt in tqdm(prompts, desc="naive reference"):
            started = time.perf_counter()
            naive_answers.append(naive.generate(prompt)[0])
            naive_seconds.append(time.perf_counter() - started)
        report("naive reference", naive_seconds, fused_tokens, counters(fuser), len(prompts))
        naive_time = sum(naive_seconds)
        agreement = sum(a == b for a, b in zip(fused, naive_answers)) / len(prompts)

    single_seconds = {}
    for backend in fuser.backends:
        seconds = []
        for prompt, length in tqdm(list(zip(prompts, fused_tokens)), desc=backend.name):
            ids = torch.tensor([backend.encode_prompt(prompt)], device=backend.model.device)
            started = time.perf_counter()
            with torch.inference_mode():
                backend.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max(length, 1),
                                       min_new_tokens=max(length, 1), pad_token_id=backend.pad_token_id)
            seconds.append(time.perf_counter() - started)
        single_seconds[backend.name] = sum(seconds)
        prompt_tokens = sum(len(backend.encode_prompt(p)) for p in prompts)
        per_model = {backend.name: {"forward_passes": sum(max(t, 1) for t in fused_tokens),
                                    "tokens": prompt_tokens + sum(max(t, 1) - 1 for t in fused_tokens)}}
        report(f"{backend.name} generate", seconds, fused_tokens, per_model, len(prompts))

    batch = prompts[: args.batch_size]
    together = batch_against_alone(fuser, batch, primer, args.repeats)
    without_reuse = batch_against_alone(fuser, batch, None, args.repeats)
    rolling = batch_against_alone(fuser, prompts, primer, args.repeats, max_batch_size=args.batch_size)

    print("\nfigures")
    if naive_time is not None:
        print(f"  speed-up over naive reference: {naive_time / sum(fused_seconds):.1f}x   answers identical: {agreement:.0%}")
    singles = sum(single_seconds.values())
    print(f"  fused time / sum of single-model generate times (same output tokens): {sum(fused_seconds) / singles:.2f} "
          f"(without prefix reuse: {sum(cold_seconds) / singles:.2f}); answers equal with/without reuse: "
          f"{sum(a == b for a, b in zip(fused, cold)) / len(prompts):.0%}")
    print_throughput(f"batch of {len(batch)}", together)
    steps_alone = {name: sum(r.stats.forward_passes[name] for r in together.alone) for name in fuser.model_names}
    steps_batch = together.batched[0].stats.forward_passes
    print("  forward steps for these prompts, alone (summed) vs batched: "
          + ", ".join(f"{name} {steps_alone[name]} vs {steps_batch[name]}" for name in fuser.model_names))
    print_throughput(f"batch of {len(batch)} without prefix reuse", without_reuse)
    print_throughput(f"all {len(prompts)} prompts, {args.batch_size} in flight (continuous batching)", rolling)


if __name__ == "__main__":
    main()
