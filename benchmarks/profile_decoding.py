"""Where decoding time goes: cProfile of the engine, and the cost of each forward by batch rows and tokens per row.

    python benchmarks/profile_decoding.py --limit 5
    python benchmarks/profile_decoding.py --limit 8 --batch-size 8
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

from bench_decoding import load_prompts, prime_prefix_caches

from adafuse import AdaFuse
from adafuse.runtime import ForwardTiming


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", default="nq", choices=["nq", "squad", "triviaqa"])
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts in flight (continuous batching)")
    args = parser.parse_args()
    prompts, stop = load_prompts(args.limit + 1, args.bench)
    fuser = AdaFuse.from_pretrained(max_new_tokens=32, stop=stop)
    fuser.generate(prompts[1:], max_batch_size=args.batch_size)  # warm-up: this run's shapes, the heap grown
    prime_prefix_caches(fuser, prompts[0])  # only the shared few-shot prefix cached, as in steady state

    forwards: dict[tuple[str, str, int, int], list[float]] = defaultdict(lambda: [0, 0.0])

    def record(timing: ForwardTiming) -> None:
        entry = forwards[(timing.model_type, timing.kind, timing.rows, timing.tokens_per_row)]
        entry[0] += 1
        entry[1] += timing.seconds

    for backend in fuser.backends:
        backend.runner.on_forward = record
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    fuser.generate(prompts[1:], max_batch_size=args.batch_size)
    profile.disable()
    total = time.perf_counter() - started
    for backend in fuser.backends:
        backend.runner.on_forward = None

    in_forward = sum(seconds for _, seconds in forwards.values())
    print(f"{args.limit} answers: {total:.2f} s, {in_forward:.2f} s ({in_forward / total:.0%}) inside model forwards")
    print("model        kind     rows  tokens/row  calls  s/call  s total")
    for (model, kind, rows, width), (calls, seconds) in sorted(forwards.items()):
        print(f"{model:<12} {kind:<8} {rows:>4} {width:>10} {calls:>6}  {seconds / calls:.3f}  {seconds:7.2f}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
