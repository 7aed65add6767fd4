"""The paper's six benchmarks: prompts exactly as in the data folder's README, answer extraction, metrics."""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..answers import first_line_answer
from .metrics import exact_match, lenient_match

Kind = Literal["qa", "math", "translation"]

__all__ = ["BENCHMARKS", "Benchmark", "benchmark_root", "final_number", "corpus_translation_scores"]


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: where its data is, how a prompt is built, when to stop and how to score."""

    name: str
    kind: Kind
    max_new_tokens: int
    stop: tuple[str, ...]

    def load(self, root: Path, limit: int | None = None, first_row: int = 0) -> tuple[str, dict[int, dict]]:
        """The few-shot prefix and `limit` development rows from `first_row` on, by row number."""
        folder = root / self.name
        if not (folder / "dev.jsonl").is_file():
            raise FileNotFoundError(f"benchmark {self.name!r}: no dev.jsonl under {folder}")
        end = first_row + limit if limit is not None else None
        with open(folder / "dev.jsonl") as handle:
            rows = {i: json.loads(line) for i, line in enumerate(itertools.islice(handle, first_row, end), start=first_row)}
        return (folder / "prompt.txt").read_text(), rows

    def prompt(self, few_shot: str, question: str) -> str:
        if self.kind == "qa":
            return f"{few_shot}\n\nQuestion: {question}\nAnswer:"
        if self.kind == "math":
            return f"{few_shot}\n\nQuestion: {question}\nLet's think step by step\n"
        return f"{few_shot}\n{question}\n"

    def extract(self, completion: str) -> str:
        """The answer a user's parser keeps: cut at a new Question: line or blank line."""
        answer = first_line_answer(completion)
        return answer.split("\n", 1)[0].strip() if self.kind == "translation" else answer

    def score_row(self, prediction: str, reference) -> dict[str, float]:
        """Per-row metrics (translation rows are scored at corpus level instead)."""
        if self.kind == "qa":
            return {"accuracy": float(lenient_match(prediction, reference)), "exact_match": float(exact_match(prediction, reference))}
        if self.kind == "math":
            gold, predicted = final_number(reference), final_number(prediction)
            return {"accuracy": float(gold is not None and predicted is not None and abs(gold - predicted) < 1e-6)}
        return {}


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("nq", "qa", 32, ("\n\n", "\nQuestion:")),
        Benchmark("triviaqa", "qa", 32, ("\n\n", "\nQuestion:")),
        Benchmark("squad", "qa", 32, ("\n\n", "\nQuestion:")),
        Benchmark("gsm8k", "math", 256, ("\n\nQuestion:", "\nQuestion:")),
        Benchmark("flores_en_de", "translation", 96, ("\n",)),
        Benchmark("flores_de_en", "translation", 96, ("\n",)),
    )
}

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def final_number(text: str) -> float | None:
    """The final numeric answer: \\boxed{N}, else "the answer is N", else the last number in the text."""
    for pattern in (r"\\boxed\{\s*\$?(" + _NUMBER + r")", r"answer is\s*:?\s*\$?(" + _NUMBER + r")"):
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return float(found[-1].replace(",", ""))
    numbers = re.findall(_NUMBER, text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def corpus_translation_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """chrF++ and corpus BLEU (13a tokenizer): sacrebleu's flores200 spBLEU tokenizer needs a download."""
    from sacrebleu.metrics import BLEU, CHRF

    return {
        "chrf++": CHRF(word_order=2).corpus_score(predictions, [references]).score,
        "bleu": BLEU().corpus_score(predictions, [references]).score,
    }


def benchmark_root(explicit: str | os.PathLike | None = None) -> Path:
    """The benchmark folder: the argument, else $ADAFUSE_DATA (the library never guesses a path)."""
    chosen = explicit or os.environ.get("ADAFUSE_DATA")
    if not chosen:
        raise FileNotFoundError("no benchmark data folder: pass one (--data) or set ADAFUSE_DATA, e.g. to ../shared/benchmarks")
    if not Path(chosen).is_dir():
        raise FileNotFoundError(f"benchmark data folder {chosen} does not exist")
    return Path(chosen)
