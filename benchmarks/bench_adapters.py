"""Token-level decoding adapter against static decoding, on held-aside generated arithmetic problems.

    python benchmarks/bench_adapters.py --adapter core/adapter_weights/smollm2-135m-token-arithmetic --limit 200

Pass@1 (one sample per problem, the same token budget for every method) of greedy decoding, fixed
temperatures, and the adapter choosing a temperature per step (argmax of its policy).
"""
from __future__ import annotations

import argparse
import time

import torch

from adafuse import ModelBackend
from adafuse.adapters import SamplingChoice, TokenAdapter
from adafuse.adaptive import AdaptiveSampler, arithmetic_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=12345, help="held-aside problems (training used seed 0)")
    args = parser.parse_args()
    adapter = TokenAdapter.load(args.adapter)
    backend = ModelBackend.from_pretrained(adapter.base_model)
    tasks = arithmetic_tasks(args.limit, seed=args.seed)
    prompts = [task.prompt for task in tasks]
    print(f"{backend.name}: {len(tasks)} held-aside arithmetic problems, budget {args.max_new_tokens} tokens")
    methods = {"greedy": (None, SamplingChoice())}
    methods.update({f"temperature {t}": (None, SamplingChoice(temperature=t)) for t in (0.3, 0.7, 1.0)})
    methods["token adapter"] = (adapter, SamplingChoice())
    for name, (policy, choice) in methods.items():
        started = time.perf_counter()
        rollouts = AdaptiveSampler(backend, policy).sample(prompts, choice=choice, max_new_tokens=args.max_new_tokens,
                                                           stop=("\n",), generator=torch.Generator().manual_seed(args.seed))
        accuracy = sum(task.check(r.text) for task, r in zip(tasks, rollouts)) / len(tasks)
        usage = ""
        if policy is not None:
            actions = torch.tensor([a for r in rollouts for a in r.actions])
            shares = torch.bincount(actions, minlength=len(policy.temperatures)) / max(1, len(actions))
            usage = "  temperatures chosen: " + ", ".join(f"{t}: {s:.0%}" for t, s in zip(policy.temperatures, shares.tolist()))
        print(f"{name:<16} Pass@1 {accuracy:.3f}  ({time.perf_counter() - started:.1f} s){usage}")


if __name__ == "__main__":
    main()
