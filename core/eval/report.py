"""The evaluation report: per-benchmark tables, fused methods against their best member, and plots."""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from ..files import write_atomically, write_text_atomically
from .benchmarks import BENCHMARKS, Benchmark, corpus_translation_scores
from .comparison import compare_with_members
from .methods import ensemble_of

__all__ = ["write_report"]


def write_report(records: list[dict], out_dir: Path, model_names: list[str], seed: int, command: str) -> Path:
    """Aggregate prediction records into report.md, summary.json and PNG plots in `out_dir`; return the report path."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["bench"], record["method"])].append(record)
    summary = {key: _summarise(BENCHMARKS[key[0]], rows) for key, rows in groups.items()}
    lines = [
        "# AdaFuse evaluation", "", f"Command: `{command}`", "",
        f"Models: {', '.join(model_names)}. Greedy and deterministic (seed {seed}).",
        "QA accuracy is lenient matching (any accepted answer inside the normalised prediction); EM is strict.",
        "Translation uses chrF++ and corpus BLEU (sacrebleu 13a tokenizer): the flores200 spBLEU tokenizer needs a "
        "download, and evaluation runs offline.", "",
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
    lines += _comparison_lines(groups, model_names)
    for figure in _plots(summary, out_dir):
        lines += [f"![{figure.stem}]({figure.name})", ""]
    path = out_dir / "report.md"
    write_text_atomically(path, "\n".join(lines))
    write_text_atomically(out_dir / "summary.json", json.dumps({f"{b}/{m}": s for (b, m), s in summary.items()}, indent=1))
    return path


def _comparison_lines(groups: dict[tuple[str, str], list[dict]], model_names: list[str]) -> list[str]:
    """Per benchmark, each fused method against the best of its own members (on the rows all answered)."""
    lines = []
    for bench in dict.fromkeys(b for b, _ in groups):
        table = []
        for (b, method), records in groups.items():
            if b != bench or method.startswith("single:"):
                continue
            try:
                members = ensemble_of(method, model_names)
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
