"""Evaluation harness: methods x benchmarks through one engine, resumable JSONL, Markdown report and plots."""
from __future__ import annotations

import json
import logging
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .benchmarks import BENCHMARKS, Benchmark, corpus_translation_scores
from .comparison import compare_with_members
from .config import FusionConfig
from .engine import AdaFuse
from .files import append_jsonl, read_jsonl, write_atomically, write_text_atomically

logger = logging.getLogger(__name__)

__all__ = ["Evaluator", "expand_methods"]

ABLATIONS = ["adafuse:B=1", "fixed:1", "fixed:2", "fixed:3"]
BASELINES = ["unite", "rerank"]
TAU_SWEEP = ["adafuse:tau=0.3", "adafuse:tau=0.5", "adafuse:tau=0.9"]
_BATCHES_PER_WRITE = 4


def expand_methods(spec: str, model_names: list[str]) -> list[str]:
    """Method names from a comma list; `single`, `ablations`, `baselines`, `sweep` and `all` expand.

    A fused method runs on every loaded model, or, with a suffix `@a+b`, on the named ones only (`rerank@a+b`,
    `adafuse:scoring=mean@a+b`), so one run compares several ensembles against the same single-model rows."""
    groups = {
        "single": [f"single:{name}" for name in model_names],
        "ablations": ABLATIONS,
        "baselines": BASELINES,
        "sweep": TAU_SWEEP,
    }
    groups["all"] = [*groups["single"], "adafuse", *ABLATIONS, *BASELINES, *TAU_SWEEP]
    methods: list[str] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        for method in groups.get(item, [item]):
            _method_overrides(method, model_names)  # validates the name
            if method not in methods:
                methods.append(method)
    return methods


def ensemble_of(method: str, model_names: list[str]) -> list[str]:
    """The models a method runs on: its `@a+b` suffix, its single model, or all of them."""
    method, _, members = method.partition("@")
    if method.startswith("single:"):
        return [method.split(":", 1)[1]]
    chosen = members.split("+") if members else list(model_names)
    unknown = [name for name in chosen if name not in model_names]
    if unknown or len(set(chosen)) != len(chosen) or len(chosen) < 2:
        raise ValueError(f"method {method!r}: ensemble {chosen} must name two or more of the loaded models {model_names}")
    return chosen


_ADAFUSE_OPTIONS = {"tau": ("tau_delta", float), "B": ("num_branches", int), "gate": ("fusion_gate", str),
                    "scoring": ("scoring", str), "sharpness": ("competence_sharpness", float),
                    "norm": ("span_normalization", str)}


def _method_overrides(method: str, model_names: list[str]) -> dict[str, Any]:
    """Engine overrides that implement a method (single models, rerank are handled by the evaluator)."""
    method, _, members = method.partition("@")
    if members:
        ensemble_of(f"{method}@{members}", model_names)
    kind, _, argument = method.partition(":")
    if kind == "single" and argument in model_names:
        return {}
    if kind == "rerank" and not argument:
        return {}
    if kind == "unite" and not argument:
        return {"unit": "token"}
    if kind == "fixed" and argument.isdigit() and int(argument) >= 1:
        return {"fixed_span_words": int(argument)}
    if kind == "adafuse":
        if not argument:
            return {}
        overrides = {}
        for option in argument.split(";"):
            name, _, value = option.partition("=")
            if name not in _ADAFUSE_OPTIONS or not value:
                break
            field_name, kind_of = _ADAFUSE_OPTIONS[name]
            try:
                overrides[field_name] = kind_of(value)
            except ValueError:
                break
        else:
            return overrides
    raise ValueError(
        f"unknown method {method!r}: use single:<model> ({', '.join(model_names)}), adafuse, adafuse:tau=X, "
        f"adafuse:B=N, adafuse:gate=<folder or shipped name>, adafuse:scoring=mean|competence, adafuse:sharpness=X, adafuse:norm=token|char|total, "
        f"several joined by ';' (adafuse:norm=char;scoring=mean), "
        f"fixed:N, unite, rerank (any fused one with @model+model), or the groups single, ablations, baselines, sweep, all"
    )


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
        self._singles = {b.name: AdaFuse([b], FusionConfig(tau_delta=0.0, num_branches=1)) for b in fuser.backends}
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
        # Every method is judged by its first non-empty answer: a leading newline does not end the answer.
        options = {"max_new_tokens": budget, "stop": list(bench.stop), "stop_after_text": True, "max_batch_size": batch_size}
        if method.startswith("single:"):
            return _outcomes(self._singles[method.split(":", 1)[1]].generate(prompts, **options))
        engine = self._ensemble(method)
        if method.partition("@")[0] == "rerank":
            return self._rerank(engine, prompts, options)
        overrides = _method_overrides(method, self.fuser.model_names)
        return _outcomes(engine.generate(prompts, **options, **overrides))

    def _rerank(self, engine: AdaFuse, prompts: list[str], options: dict[str, Any]) -> list[_Outcome]:
        """Sample-level selection: each model answers alone; the answer with the lowest mean NLL across models wins."""
        singles = {name: self._singles[name] for name in engine.model_names}
        answers = {name: _outcomes(single.generate(prompts, **options)) for name, single in singles.items()}
        outcomes = []
        for i, prompt in enumerate(prompts):
            mine = [answers[name][i] for name in singles]
            passes = {name: outcome.forward_passes[name] for name, outcome in zip(singles, mine)}
            seconds = sum(outcome.wall_time_s for outcome in mine)
            texts = list(dict.fromkeys(o.completion for o in mine if o.completion.strip()))
            best = ""
            if texts:
                started = time.perf_counter()
                scores = engine.score(prompt, texts)
                seconds += time.perf_counter() - started
                best = texts[min(range(len(texts)), key=lambda t: sum(scores[t]))]
                for backend in engine.backends:
                    passes[backend.name] += backend.reset_counters()["forward_passes"]
            outcomes.append(_Outcome(best, seconds, passes, 1, 0, [], {}))
        return outcomes

    # ------------------------------------------------------------------ report
    def report(self, command: str) -> Path:
        """Aggregate the JSONL into report.md and PNG plots; return the report path."""
        records = read_jsonl(self.predictions)
        groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for record in records:
            groups[(record["bench"], record["method"])].append(record)
        summary = {key: _summarise(BENCHMARKS[key[0]], rows) for key, rows in groups.items()}
        lines = [
            "# AdaFuse evaluation", "", f"Command: `{command}`", "",
            f"Models: {', '.join(self.fuser.model_names)}. Greedy and deterministic (seed {self.fuser.config.seed}).",
            "QA accuracy is lenient matching (any accepted answer inside the normalised prediction); EM is strict.",
            "Translation uses chrF++ and corpus BLEU (sacrebleu 13a tokenizer): the flores200 spBLEU tokenizer needs a "
            "download, which this machine cannot make.", "",
        ]
        for bench in dict.fromkeys(b for b, _ in summary):
            metric_names = next(s["metrics"] for (b, _), s in summary.items() if b == bench).keys()
            lines += [f"## {bench}", "", "| method | rows | " + " | ".join(metric_names) +
                      " | s/example | forward passes/example (per model) | rounds | explored rounds | words/round |",
                      "|" + "---|" * (len(metric_names) + 7)]
            for (b, method), s in summary.items():
                if b != bench:
                    continue
                metrics = " | ".join(f"{s['metrics'][m]:.3f}" if m in s["metrics"] else "" for m in metric_names)
                passes = ", ".join(f"{k}: {v:.1f}" for k, v in s["forward_passes"].items())
                histogram = " ".join(f"{k}:{v}" for k, v in sorted(s["words_histogram"].items()))
                lines.append(f"| {method} | {s['rows']} | {metrics} | {s['wall_time_s']:.2f} | {passes} | "
                             f"{s['rounds']:.1f} | {s['explored_share']:.0%} | {histogram} |")
            lines.append("")
        lines += self._comparison_lines(groups)
        for figure in _plots(summary, self.out_dir):
            lines += [f"![{figure.stem}]({figure.name})", ""]
        path = self.out_dir / "report.md"
        write_text_atomically(path, "\n".join(lines))
        write_text_atomically(self.out_dir / "summary.json", json.dumps({f"{b}/{m}": s for (b, m), s in summary.items()}, indent=1))
        return path


    def _comparison_lines(self, groups: dict[tuple[str, str], list[dict]]) -> list[str]:
        """Per benchmark, each fused method against the best of its own members (on the rows all answered)."""
        lines = []
        for bench in dict.fromkeys(b for b, _ in groups):
            table = []
            for (b, method), records in groups.items():
                if b != bench or method.startswith("single:"):
                    continue
                try:
                    members = ensemble_of(method, self.fuser.model_names)
                except ValueError:
                    continue
                singles = {name: groups.get((bench, f"single:{name}")) for name in members}
                if not all(singles.values()):
                    continue
                c = compare_with_members(BENCHMARKS[bench], {r["index"]: r for r in records},
                                         {name: {r["index"]: r for r in rows} for name, rows in singles.items()})
                if c:
                    table.append(f"| {method} | {c['rows']} | {c['best_member']} {c['best_member_score']:.3f} | "
                                 f"{c['fused_score']:.3f} | {c['difference']:+.3f} [{c['interval'][0]:+.3f}, "
                                 f"{c['interval'][1]:+.3f}] | {c['wins']} / {c['losses']} | {c['oracle']:.3f} |")
            if table:
                lines += [f"## {bench}: fused against its best member", "",
                          "| method | rows | best member | fused | difference [bootstrap 95%] | wins / losses | oracle |",
                          "|---|---|---|---|---|---|---|", *table, ""]
        return lines


def _outcomes(results) -> list[_Outcome]:
    share = len(results)
    return [
        _Outcome(r.text, r.stats.wall_time_s / share, {k: v / share for k, v in r.stats.forward_passes.items()},
                 r.stats.rounds, r.stats.explorations, r.stats.words_per_round, r.stats.model_weights)
        for r in results
    ]


def _summarise(bench: Benchmark, rows: list[dict]) -> dict[str, Any]:
    count = len(rows)
    if bench.kind == "translation":
        metrics = corpus_translation_scores([r["prediction"] for r in rows], [r["reference"] for r in rows])
    else:
        metrics = {name: sum(r["metrics"][name] for r in rows) / count for name in rows[0]["metrics"]}
    passes: dict[str, float] = defaultdict(float)
    for r in rows:
        for model, value in r["forward_passes"].items():
            passes[model] += value / count
    rounds = sum(r["rounds"] for r in rows)
    model_rounds = sum(r["rounds"] * r["models"] for r in rows)
    return {
        "rows": count,
        "metrics": metrics,
        "primary": next(iter(metrics.values())),
        "wall_time_s": sum(r["wall_time_s"] for r in rows) / count,
        "forward_passes": dict(passes),
        "rounds": rounds / count,
        "explored_share": sum(r["explorations"] for r in rows) / model_rounds if model_rounds else 0.0,
        "words_histogram": dict(Counter(w for r in rows for w in r["words_per_round"])),
    }


def _plots(summary: dict[tuple[str, str], dict], out_dir: Path) -> list[Path]:
    """Accuracy against forward passes per method, the τΔ sweep, and AdaFuse's words-per-round histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(b for b, _ in summary))
    figures = []
    fig, axes = plt.subplots(1, len(benches), figsize=(4 * len(benches), 3.4), squeeze=False)
    for axis, bench in zip(axes[0], benches):
        for (b, method), s in summary.items():
            if b == bench:
                axis.scatter(sum(s["forward_passes"].values()), s["primary"])
                axis.annotate(method, (sum(s["forward_passes"].values()), s["primary"]), fontsize=7)
        axis.set_title(bench)
        axis.set_xlabel("forward passes / example (all models)")
    axes[0][0].set_ylabel("primary metric")
    fig.tight_layout()
    figures.append(out_dir / "accuracy_vs_forward_passes.png")
    write_atomically(figures[-1], lambda temporary: fig.savefig(temporary, format="png", dpi=100))
    plt.close(fig)

    sweep = {b: sorted((float(m.split("=")[1]) if "tau=" in m else 0.7, s["primary"]) for (bb, m), s in summary.items()
                       if bb == b and (m == "adafuse" or m.startswith("adafuse:tau="))) for b in benches}
    if any(len(points) > 1 for points in sweep.values()):
        fig, axis = plt.subplots(figsize=(5, 3.4))
        for bench, points in sweep.items():
            if len(points) > 1:
                axis.plot(*zip(*points), "o-", label=bench)
        axis.set_xlabel("τΔ")
        axis.set_ylabel("primary metric")
        axis.legend(fontsize=7)
        fig.tight_layout()
        figures.append(out_dir / "tau_sweep.png")
        write_atomically(figures[-1], lambda temporary: fig.savefig(temporary, format="png", dpi=100))
        plt.close(fig)

    histogram: Counter = Counter()
    for (_, method), s in summary.items():
        if method == "adafuse":
            histogram.update({int(k): v for k, v in s["words_histogram"].items()})
    if histogram:
        fig, axis = plt.subplots(figsize=(5, 3.4))
        axis.bar(list(histogram), list(histogram.values()))
        axis.set_xlabel("words committed per round (AdaFuse)")
        axis.set_ylabel("rounds")
        fig.tight_layout()
        figures.append(out_dir / "words_per_round.png")
        write_atomically(figures[-1], lambda temporary: fig.savefig(temporary, format="png", dpi=100))
        plt.close(fig)
    return figures
