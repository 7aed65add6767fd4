"""Does fusion beat its members? Oracle, paired wins and losses, and a bootstrap interval of the difference."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from .benchmarks import Benchmark

__all__ = ["compare_with_members", "row_statistics"]


def row_statistics(bench: Benchmark, records: Sequence[dict]) -> list[list[float]]:
    """Per row, what its benchmark's corpus metric sums: chrF++ character/word n-gram counts for translation,
    the primary metric itself elsewhere."""
    if bench.kind != "translation":
        return [[next(iter(r["metrics"].values()))] for r in records]
    from sacrebleu.metrics import CHRF

    chrf = CHRF(word_order=2)
    return [list(chrf._extract_corpus_statistics([r["prediction"]], [[r["reference"]]])[0]) for r in records]


def _corpus(bench: Benchmark, stats: Sequence[Sequence[float]]) -> float:
    if not stats:
        return 0.0
    if bench.kind != "translation":
        return sum(s[0] for s in stats) / len(stats)
    from sacrebleu.metrics import CHRF

    return CHRF(word_order=2)._compute_score_from_stats([sum(column) for column in zip(*stats)]).score


def compare_with_members(bench: Benchmark, fused: dict[int, dict], members: dict[str, dict[int, dict]],
                         resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Compare a fused method with the best of its members on the rows all of them answered.

    A row is a win (loss) when the fused answer scores above (below) the best member's on it (sentence chrF++ for
    translation); the oracle takes, per row, the member whose answer scores best; the interval is the 2.5-97.5
    percentile of the corpus-metric difference over `resamples` bootstrap resamples of the rows."""
    rows = sorted(set(fused).intersection(*members.values()))
    if not rows:
        return {}
    stats = {name: row_statistics(bench, [table[i] for i in rows]) for name, table in members.items()}
    mine = row_statistics(bench, [fused[i] for i in rows])
    best = max(stats, key=lambda name: _corpus(bench, stats[name]))
    single = [_corpus(bench, [s]) for s in stats[best]]
    own = [_corpus(bench, [s]) for s in mine]
    oracle = [max((stats[name][k] for name in stats), key=lambda s: _corpus(bench, [s])) for k in range(len(rows))]
    generator = random.Random(seed)
    differences = []
    for _ in range(resamples):
        sample = [generator.randrange(len(rows)) for _ in rows]
        differences.append(_corpus(bench, [mine[k] for k in sample]) - _corpus(bench, [stats[best][k] for k in sample]))
    differences.sort()
    return {
        "rows": len(rows),
        "best_member": best,
        "best_member_score": _corpus(bench, stats[best]),
        "fused_score": _corpus(bench, mine),
        "difference": _corpus(bench, mine) - _corpus(bench, stats[best]),
        "interval": (differences[int(0.025 * resamples)], differences[int(0.975 * resamples) - 1]),
        "wins": sum(a > b for a, b in zip(own, single)),
        "losses": sum(a < b for a, b in zip(own, single)),
        "oracle": _corpus(bench, oracle),
    }
