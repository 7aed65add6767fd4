"""AdaFuse with a fixed τΔ against the learned fusion gate, on held-aside problems: accuracy and compute.

    python benchmarks/bench_fusion_gate.py --gate core/adapter_weights/adafuse-default-gate-arithmetic --limit 200
    python benchmarks/bench_fusion_gate.py --gate adafuse-default-gate-squad adafuse-default-gate-arithmetic \
        --task squad --first-row 200 --limit 100 --max-new-tokens 32 --taus 0,0.7,1

Prints, per method, accuracy, the forward passes each answer took (all models, as if decoded alone),
explorations per round and seconds per answer, and plots accuracy against forward passes (the τΔ sweep as a
curve, the gate as a point).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from adafuse import AdaFuse
from adafuse.training.tasks import arithmetic_tasks, benchmark_tasks, task_stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("ADAFUSE_DATA", "../shared/benchmarks"), help="benchmark folder")
    parser.add_argument("--gate", nargs="+", required=True, help="fusion gate folders or shipped names")
    parser.add_argument("--task", default="arithmetic", help="arithmetic or a QA/math benchmark")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--first-row", type=int, default=200, help="benchmark tasks: first held-aside row")
    parser.add_argument("--seed", type=int, default=12345, help="arithmetic: held-aside problems (training used seed 0)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--taus", default="0,0.3,0.5,0.7,0.9,1")
    parser.add_argument("--plot", default=None, help="default: reports/fusion_gate_<task>.png")
    args = parser.parse_args()

    if args.task == "arithmetic":
        tasks = arithmetic_tasks(args.limit, seed=args.seed)
    else:
        tasks = benchmark_tasks(args.task, range(args.first_row, args.first_row + args.limit), args.data)
    fuser = AdaFuse.from_pretrained(max_new_tokens=args.max_new_tokens, stop=list(task_stop(tasks)))
    fuser.generate(tasks[0].prompt)  # warm-up
    print(f"{args.task}: {len(tasks)} held-aside tasks, max_new_tokens={args.max_new_tokens}, batch {args.batch_size}")
    methods = {f"tau {float(tau):g}": {"tau_delta": float(tau)} for tau in args.taus.split(",")}
    methods.update({f"gate {Path(gate).name}": {"fusion_gate": gate} for gate in args.gate})
    points = {}
    for name, options in methods.items():
        started = time.perf_counter()
        results = fuser.generate([t.prompt for t in tasks], max_batch_size=args.batch_size, **options)
        seconds = time.perf_counter() - started
        accuracy = sum(t.check(r.text) for t, r in zip(tasks, results)) / len(tasks)
        passes = sum(sum(r.stats.row_forward_passes.values()) for r in results) / len(tasks)
        rounds = sum(r.stats.rounds for r in results)
        explored = sum(r.stats.explorations for r in results) / max(1, rounds * len(fuser.backends))
        points[name] = (passes, accuracy)
        print(f"{name:<44} accuracy {accuracy:.3f}  forward passes/answer {passes:5.1f}  explored {explored:4.0%}  "
              f"rounds/answer {rounds / len(tasks):.2f}  {seconds / len(tasks):.2f} s/answer", flush=True)
    plot(points, args.task, Path(args.plot or f"reports/fusion_gate_{args.task}.png"))


def plot(points: dict[str, tuple[float, float]], task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    sweep = sorted(v for k, v in points.items() if k.startswith("tau"))
    axis.plot([p for p, _ in sweep], [a for _, a in sweep], "o-", label="fixed τΔ (0 to 1)")
    for name, (p, a) in points.items():
        if name.startswith("tau"):
            axis.annotate(name.split()[1], (p, a), textcoords="offset points", xytext=(3, 3), fontsize=7)
    for (name, (p, a)), marker in zip(((k, v) for k, v in points.items() if k.startswith("gate")), "*Ps"):
        axis.plot([p], [a], marker, color="red", markersize=11, linestyle="none", label=name)
    axis.set_xlabel("forward passes per answer (all models)")
    axis.set_ylabel("accuracy")
    axis.set_title(f"AdaFuse on held-aside {task}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
