"""Seconds per fused answer alone and beside a busy 2-thread torch process, per OpenMP wait policy.

OpenMP threads that finish their share of a parallel region spin, waiting for the next one; beside another
process on the same cores the spinning takes the cores that process needs, and both slow down by far more
than their share. `OMP_WAIT_POLICY=PASSIVE` makes waiting threads sleep at once; `GOMP_SPINCOUNT` bounds the
spinning. Both must be set before torch loads, so each setting runs in its own process.

    .venv/bin/python benchmarks/bench_contention.py --answers 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Question: What is the capital of France?\nAnswer: Paris\n\nQuestion: Who wrote Romeo and Juliet?\nAnswer:"
COMPETITOR = (
    "import torch\n"
    "a = torch.randn(512, 512)\n"
    "while True:\n"
    "    for _ in range(20):\n"
    "        a = torch.tanh(a @ a)\n"
)


# Our process's OpenMP wait settings: libgomp (PyTorch's CPU build) spins 300,000 times before it sleeps unless
# told otherwise, PASSIVE sleeps at once, GOMP_SPINCOUNT sets the spins; adafuse, unset, bounds them (`_threads`).
SETTINGS = {
    "libgomp default (300k spins)": {"GOMP_SPINCOUNT": "300000"},
    "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "30k spins": {"GOMP_SPINCOUNT": "30000"},
    "adafuse default (10k spins)": {},
}


def _environment(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return env | {"OMP_NUM_THREADS": "2"} | setting


def _answer_seconds(answers: int) -> None:
    """Child process: load the default pair, warm up, print the median wall time of `answers` fused answers."""
    from adafuse import AdaFuse

    fuser = AdaFuse.from_pretrained()
    fuser.generate(PROMPT, stop=["\n"], max_new_tokens=16)
    times = []
    for _ in range(answers):
        started = time.perf_counter()
        fuser.generate(PROMPT, stop=["\n"], max_new_tokens=16)
        times.append(time.perf_counter() - started)
    print(f"{statistics.median(times):.2f} {min(times):.2f} {max(times):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _answer_seconds(args.answers)
        return
    print("ours\tcompetitor\tmedian s\tmin s\tmax s")
    for ours, setting in SETTINGS.items():
        for busy in (False, True):
            rival = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=_environment({})) if busy else None
            try:
                out = subprocess.run([sys.executable, __file__, "--child", "--answers", str(args.answers)],
                                     env=_environment(setting), capture_output=True, text=True, check=True).stdout
            finally:
                if rival is not None:
                    rival.kill()
                    rival.wait()
            median, low, high = out.split()
            print(f"{ours}\t{'busy (default)' if busy else 'none'}\t{median}\t{low}\t{high}", flush=True)

if __name__ == "__main__":
    main()
