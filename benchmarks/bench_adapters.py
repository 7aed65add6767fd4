"""Learned decoding adapters against static decoding, on held-aside rows of their training task.

    python benchmarks/bench_adapters.py --adapter core/adapter_weights/smollm2-135m-token-arithmetic \
        --sequence-adapter core/adapter_weights/smollm2-135m-sequence-arithmetic --limit 200
    python benchmarks/bench_adapters.py --adapter core/adapter_weights/gemma3-270m-token-squad \
        --sequence-adapter core/adapter_weights/gemma3-270m-sequence-squad --task squad --first-row 200 \
        --limit 100 --max-new-tokens 16 --plot reports/adapters_budget_squad.png

Token level: Pass@1 (one sample per problem, the same token budget for every method) of greedy decoding,
fixed temperatures, and the adapter choosing a temperature per step (argmax of its policy).
Sequence level: accuracy of the majority vote over B samples, B = 1, 4, 8, for each static configuration of
the adapter's action set and for the adapter's per-prompt choice.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from adafuse import ModelBackend
from adafuse import SamplingFilter
from adafuse.sampling.policies import SequenceAdapter, TokenAdapter
from adafuse.sampling.adaptive import AdaptiveSampler, prompt_embeddings
from adafuse.training.adapters import best_of
from adafuse.training.tasks import arithmetic_tasks, benchmark_tasks, task_stop

# Rows decoded together: bounds the KV cache of long benchmark prompts.
BATCH_ROWS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.environ.get("ADAFUSE_DATA", "../shared/benchmarks"), help="benchmark folder")
    parser.add_argument("--adapter", required=True, help="token adapter folder")
    parser.add_argument("--sequence-adapter", default=None, help="sequence adapter folder")
    parser.add_argument("--task", default="arithmetic", help="arithmetic or a QA/math benchmark (e.g. squad)")
    parser.add_argument("--first-row", type=int, default=200, help="benchmark tasks: first held-aside row")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=12345, help="arithmetic: held-aside problems (training used seed 0)")
    parser.add_argument("--plot", default="reports/adapters_budget.png", help="accuracy against the sample budget B")
    args = parser.parse_args()
    adapter = TokenAdapter.load(args.adapter)
    backend = ModelBackend.from_pretrained(adapter.base_model)
    if args.task == "arithmetic":
        tasks = arithmetic_tasks(args.limit, seed=args.seed)
    else:
        tasks = benchmark_tasks(args.task, range(args.first_row, args.first_row + args.limit), args.data)
    prompts = [task.prompt for task in tasks]
    print(f"{backend.name}: {len(tasks)} held-aside {args.task} tasks, budget {args.max_new_tokens} tokens")
    methods = {"greedy": (None, SamplingFilter())}
    methods.update({f"temperature {t}": (None, SamplingFilter(temperature=t)) for t in (0.3, 0.7, 1.0)})
    methods["token adapter"] = (adapter, SamplingFilter())
    for name, (policy, choice) in methods.items():
        started = time.perf_counter()
        rollouts = AdaptiveSampler(backend, policy).sample(prompts, choice=choice, max_new_tokens=args.max_new_tokens,
                                                           stop=task_stop(tasks), generator=torch.Generator().manual_seed(args.seed),
                                                           max_batch_rows=BATCH_ROWS)
        accuracy = sum(task.check(r.text) for task, r in zip(tasks, rollouts)) / len(tasks)
        usage = ""
        if policy is not None:
            actions = torch.tensor([a for r in rollouts for a in r.actions])
            shares = torch.bincount(actions, minlength=len(policy.temperatures)) / max(1, len(actions))
            usage = "  temperatures chosen: " + ", ".join(f"{t}: {s:.0%}" for t, s in zip(policy.temperatures, shares.tolist()))
        print(f"{name:<16} Pass@1 {accuracy:.3f}  ({time.perf_counter() - started:.1f} s){usage}")
    if args.sequence_adapter:
        compare_sequence_adapter(SequenceAdapter.load(args.sequence_adapter), backend, tasks, args)


def compare_sequence_adapter(adapter: SequenceAdapter, backend: ModelBackend, tasks, args) -> None:
    sampler = AdaptiveSampler(backend)
    embeddings = prompt_embeddings(backend, [task.prompt for task in tasks])
    print("\nsequence level: majority vote over B samples")
    curves: dict[str, list[float]] = {"best static configuration": [], "sequence adapter": []}
    budgets = (1, 4, 8)
    for budget in budgets:
        generator = torch.Generator().manual_seed(args.seed + budget)
        static = {choice: sum(best_of(sampler, tasks, choice, budget, args.max_new_tokens, generator)) / len(tasks)
                  for choice in adapter.choices}
        picks = [adapter.choose(e, budget) for e in embeddings]
        solved = 0
        for choice in set(picks):
            group = [task for task, pick in zip(tasks, picks) if pick == choice]
            solved += sum(best_of(sampler, group, choice, budget, args.max_new_tokens, generator))
        best = max(static, key=static.get)
        shares = ", ".join(f"{_label(c)}: {picks.count(c) / len(picks):.0%}" for c in adapter.choices)
        print(f"B={budget}: best static {_label(best)} {static[best]:.3f}; adapter {solved / len(tasks):.3f}  (adapter picks {shares})",
              flush=True)
        curves["best static configuration"].append(static[best])
        curves["sequence adapter"].append(solved / len(tasks))
    _plot(budgets, curves, args.plot, args.task)


def _plot(budgets: tuple[int, ...], curves: dict[str, list[float]], path: str, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3.5))
    for label, values in curves.items():
        axis.plot(budgets, values, "o-", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xticks(budgets, [str(b) for b in budgets])
    axis.set_xlabel("parallel samples B (majority vote)")
    axis.set_ylabel(f"accuracy (held-aside {task})")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot: {path}")


def _label(choice: SamplingFilter) -> str:
    if choice.temperature == 0:
        return "greedy"
    extras = [f"{k}={v}" for k, v in (("top_k", choice.top_k), ("top_p", choice.top_p), ("min_p", choice.min_p))
              if v != SamplingFilter.__dataclass_fields__[k].default]
    return "T=" + str(choice.temperature) + ("," + ",".join(extras) if extras else "")


if __name__ == "__main__":
    main()
