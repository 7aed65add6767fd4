"""What a generation returns: text, why it stopped, work counters and, on request, every round's choice."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

FinishReason = Literal["eos", "stop", "length"]

__all__ = ["CandidateTrace", "RoundTrace", "DecodingStats", "GenerationResult"]


@dataclass
class CandidateTrace:
    """One pooled candidate span: who proposed it and every model's mean NLL of it."""

    text: str
    ends: bool
    proposers: list[str]
    nll: dict[str, float]
    score: float


@dataclass
class RoundTrace:
    """One decoding round: each model's first-token margin, whether it explored, the candidates, the choice."""

    index: int
    margins: dict[str, float]
    explored: dict[str, bool]
    candidates: list[CandidateTrace]
    chosen: str


@dataclass
class DecodingStats:
    """Work done for one generation call.

    `forward_passes` and `tokens_processed` cover the whole batch the prompt ran in; `row_forward_passes` counts
    the forward passes this prompt took part in, per model: what it would have needed decoded alone. For a served
    model a forward pass is one step of concurrent requests, and `requests` counts the HTTP requests.
    """

    rounds: int = 0
    words_per_round: list[int] = field(default_factory=list)
    explorations: int = 0
    new_tokens: int = 0  # of the answer, in the first model's tokens
    prompt_tokens: dict[str, int] = field(default_factory=dict)  # the rendered prompt's length for each model
    forward_passes: dict[str, int] = field(default_factory=dict)
    row_forward_passes: dict[str, int] = field(default_factory=dict)
    tokens_processed: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)  # served models only
    batch_size: int = 1
    wall_time_s: float = 0.0
    model_weights: dict[str, float] = field(default_factory=dict)  # each model's weight in this prompt's fused scores

    @property
    def words_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.words_per_round).items()))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "words_histogram": self.words_histogram}


@dataclass
class GenerationResult:
    """Generated text (prompt excluded), why it stopped ("eos", "stop" sequence or "length"), stats, trace."""

    text: str
    finish_reason: FinishReason
    stats: DecodingStats
    trace: list[RoundTrace] | None = None
