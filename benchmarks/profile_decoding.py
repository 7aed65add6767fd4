"""Where decoding time goes: cProfile of the engine, and the cost of each forward by tokens fed per row.

    python benchmarks/profile_decoding.py --limit 5
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

from bench_decoding import load_prompts

from adafuse import AdaFuse, kv_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5)
    args = parser.parse_args()
    prompts = load_prompts(args.limit + 1)
    fuser = AdaFuse.from_pretrained(max_new_tokens=32, stop=["\n"])
    fuser.generate(prompts[0])  # warm-up, and the shared few-shot prefix is cached as in steady state

    forwards: dict[tuple[str, str, int], list[float]] = defaultdict(lambda: [0, 0.0])
    run = kv_tree.TreeBatch._run

    def timed(self, input_ids, mask, positions, logits_to_keep=0):
        started = time.perf_counter()
        logits = run(self, input_ids, mask, positions, logits_to_keep)
        entry = forwards[(self.model.config.model_type, "prefill" if logits_to_keep else "step", input_ids.shape[1])]
        entry[0] += 1
        entry[1] += time.perf_counter() - started
        return logits

    kv_tree.TreeBatch._run = timed
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    for prompt in prompts[1:]:
        fuser.generate(prompt)
    profile.disable()
    total = time.perf_counter() - started
    kv_tree.TreeBatch._run = run

    in_forward = sum(seconds for _, seconds in forwards.values())
    print(f"{args.limit} answers: {total:.2f} s, {in_forward:.2f} s ({in_forward / total:.0%}) inside model forwards")
    print("model        kind     tokens/row  calls  s/call")
    for (model, kind, width), (calls, seconds) in sorted(forwards.items()):
        print(f"{model:<12} {kind:<8} {width:>10} {calls:>6}  {seconds / calls:.3f}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
