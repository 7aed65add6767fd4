"""Resident memory over many generations of varied prompt lengths: it must level off, not grow with every shape.

oneDNN caches one kernel per input shape; the packed linear layers round row counts up to a bounded set of
sizes (`adafuse.kernels.cpu.row_bucket`) so that cache stays small. `--no-bucketing` shows the growth without.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_memory.py --generations 2000
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

from tqdm import tqdm

from adafuse import AdaFuse
from adafuse.kernels.cpu import PackedLinear

WORDS = "the river bank moon football ensemble decoding fuses several language models words".split()


def rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--generations", type=int, default=2000)
    parser.add_argument("--max-words", type=int, default=300, help="prompts have 1 to this many words")
    parser.add_argument("--every", type=int, default=200, help="print RSS every this many generations")
    parser.add_argument("--no-bucketing", action="store_true", help="one oneDNN shape per row count (the old way)")
    args = parser.parse_args()
    fuser = AdaFuse.from_pretrained(args.models, max_new_tokens=3, reuse_prompt_prefix=False)
    for layer in (m for b in fuser.backends for m in b.model.modules() if isinstance(m, PackedLinear)):
        layer.bucket_rows = not args.no_bucketing
    rng = random.Random(0)
    print(f"models {args.models}, bucketing {'off' if args.no_bucketing else 'on'}; RSS after loading {rss_mb():.0f} MB")
    print("generations\tRSS MB")
    for done in tqdm(range(1, args.generations + 1), unit="gen"):
        words = rng.randint(1, args.max_words)
        batch = rng.randint(1, 4)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(words)) + f" {i}" for i in range(batch)]
        fuser.generate(prompts)
        if done % args.every == 0:
            tqdm.write(f"{done}\t{rss_mb():.0f}")


if __name__ == "__main__":
    main()
