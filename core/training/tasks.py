"""Prompts with verifiable rewards for REINFORCE: generated arithmetic, or rows of a QA/math benchmark."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..eval.benchmarks import BENCHMARKS, benchmark_root, final_number

__all__ = ["Task", "arithmetic_tasks", "benchmark_tasks", "task_stop"]


@dataclass(frozen=True)
class Task:
    """A prompt with a checkable answer: `check(completion)` is the verifiable reward."""

    prompt: str
    check: Callable[[str], bool]
    stop: tuple[str, ...] = ("\n",)


def task_stop(tasks: list[Task]) -> tuple[str, ...]:
    """The stop sequences of tasks decoded together (they must agree)."""
    stops = {task.stop for task in tasks}
    if len(stops) > 1:
        raise ValueError(f"tasks decoded together need the same stop sequences, got {sorted(stops)}")
    return stops.pop() if stops else ("\n",)


def arithmetic_tasks(count: int, seed: int = 0) -> list[Task]:
    """Generated one-step sums and differences with known answers: a reward the tiny default models can earn."""
    rng = random.Random(seed)
    shots = "Question: What is 3 + 4?\nAnswer: 7\n\nQuestion: What is 9 - 5?\nAnswer: 4\n\n" \
            "Question: What is 6 + 2?\nAnswer: 8\n\nQuestion: What is 8 - 6?\nAnswer: 2\n\n"
    tasks = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {a + b} - {b}?", a
        tasks.append(Task(f"{shots}Question: {question}\nAnswer:", _number_check(answer)))
    return tasks


def benchmark_tasks(name: str, rows: range, data_root: Path | None = None) -> list[Task]:
    """Rows of one QA or math benchmark as tasks; the reward is the benchmark's own accuracy (lenient match or
    final number) of the extracted answer."""
    bench = BENCHMARKS.get(name)
    if bench is None or bench.kind == "translation":
        raise ValueError(f"unknown task {name!r}: use arithmetic or a QA/math benchmark ({', '.join(b for b, v in BENCHMARKS.items() if v.kind != 'translation')})")
    few_shot, table = bench.load(benchmark_root(data_root), len(rows), rows.start)
    return [
        Task(bench.prompt(few_shot, row["question"]),
             lambda completion, answer=row["answer"]: bench.score_row(bench.extract(completion), answer)["accuracy"] > 0,
             tuple(bench.stop))
        for row in table.values()
    ]


def _number_check(answer: float) -> Callable[[str], bool]:
    def check(completion: str) -> bool:
        found = final_number(completion.split("\n")[0] if completion.strip() else completion)
        return found is not None and abs(found - answer) < 1e-6

    return check
