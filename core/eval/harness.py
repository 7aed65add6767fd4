"""Evaluation harness: methods x benchmarks through one engine, resumable JSONL, Markdown report and plots."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import FusionConfig
from ..files import append_jsonl, read_jsonl
from ..fusion.engine import AdaFuse
from .benchmarks import BENCHMARKS, Benchmark
from .methods import engine_overrides, ensemble_of
from .report import write_report

logger = logging.getLogger(__name__)

__all__ = ["Evaluator"]

_BATCHES_PER_WRITE = 4

@dataclass
class _Outcome:
    completion: str
    wall_time_s: float
    forward_passes: dict[str, int]
    rounds: int
    explorations: int
    words_per_round: list[int]
    model_weights: dict[str, float]


class Evaluator:
    """Runs methods over benchmarks with the same loaded models and writes `predictions.jsonl` as it goes.

    `max_new_tokens` caps every benchmark's own generation budget (for quick runs).
    """

    def __init__(self, fuser: AdaFuse, data_root: Path, out_dir: Path, max_new_tokens: int | None = None):
        self.fuser = fuser
        self.max_new_tokens = max_new_tokens
        self.data_root = Path(data_root)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.predictions = self.out_dir / "predictions.jsonl"
        self._singles = {b.name: AdaFuse([b], FusionConfig().alone()) for b in fuser.backends}
        self._ensembles: dict[tuple[str, ...], AdaFuse] = {}

    def _ensemble(self, method: str) -> AdaFuse:
        """The engine over a method's models (sharing the loaded backends)."""
        names = tuple(ensemble_of(method, self.fuser.model_names))
        if names == tuple(self.fuser.model_names):
            return self.fuser
        if names not in self._ensembles:
            backends = {b.name: b for b in self.fuser.backends}
            self._ensembles[names] = AdaFuse([backends[n] for n in names], self.fuser.config)
        return self._ensembles[names]

    def done(self) -> set[tuple[str, str, int]]:
        return {(r["bench"], r["method"], r["index"]) for r in read_jsonl(self.predictions)}

    def run(self, benches: list[str], methods: list[str], limit: int | None, batch_size: int = 1, first_row: int = 0) -> None:
        """Run every method over `limit` rows (from `first_row` on) of every benchmark, `batch_size` prompts in
        flight, appending to the JSONL.

        Rows are written every few batches' worth, so an interrupted run loses little and resumes there.
        """
        unknown = [b for b in benches if b not in BENCHMARKS]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
        done = self.done()
        for name in benches:
            bench = BENCHMARKS[name]
            few_shot, rows = bench.load(self.data_root, limit, first_row)
            for method in methods:
                todo = [i for i in rows if (name, method, i) not in done]
                per_write = batch_size * _BATCHES_PER_WRITE
                chunks = [todo[i : i + per_write] for i in range(0, len(todo), per_write)]
                progress = tqdm(total=len(todo), desc=f"{name} {method}", unit="row", disable=not todo)
                for chunk in chunks:
                    prompts = [bench.prompt(few_shot, rows[i]["question"]) for i in chunk]
                    outcomes = self._run_method(method, bench, prompts, batch_size)
                    progress.update(len(chunk))
                    append_jsonl(self.predictions, [self._record(bench, method, i, rows[i], o) for i, o in zip(chunk, outcomes)])

    def _record(self, bench: Benchmark, method: str, index: int, row: dict, outcome: _Outcome) -> dict[str, Any]:
        prediction = bench.extract(outcome.completion)
        return {
            "bench": bench.name, "method": method, "index": index, "completion": outcome.completion,
            "prediction": prediction, "reference": row["answer"], "metrics": bench.score_row(prediction, row["answer"]),
            "wall_time_s": outcome.wall_time_s, "forward_passes": outcome.forward_passes, "rounds": outcome.rounds,
            "explorations": outcome.explorations, "words_per_round": outcome.words_per_round,
            "models": len(outcome.forward_passes), "model_weights": outcome.model_weights,
        }

    def _run_method(self, method: str, bench: Benchmark, prompts: list[str], batch_size: int) -> list[_Outcome]:
        budget = min(bench.max_new_tokens, self.max_new_tokens or bench.max_new_tokens)
        # Every method is judged by its first non-empty answer: it may not end before its first token, and a leading
        # newline does not end it.
        options = {"max_new_tokens": budget, "min_new_tokens": 1, "stop": list(bench.stop), "stop_after_text": True,
                   "max_batch_size": batch_size}
        if method.startswith("single:"):
            return _outcomes(self._singles[method.split(":", 1)[1]].generate(prompts, **options))
        engine = self._ensemble(method)
        overrides = engine_overrides(method, self.fuser.model_names)
        return _outcomes(engine.generate(prompts, **options, **overrides))

    def report(self, command: str) -> Path:
        """Aggregate the JSONL into report.md and PNG plots; return the report path."""
        return write_report(read_jsonl(self.predictions), self.out_dir, self.fuser.model_names, self.fuser.config.seed, command)


def _outcomes(results) -> list[_Outcome]:
    share = len(results)
    return [
        _Outcome(r.text, r.stats.wall_time_s / share, {k: v / share for k, v in r.stats.forward_passes.items()},
                 r.stats.rounds, r.stats.explorations, r.stats.words_per_round, r.stats.model_weights)
        for r in results
    ]
