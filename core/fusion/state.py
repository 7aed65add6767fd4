"""Decoding state of one prompt, shared by all models (the text is the source of truth)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..constraints import TextAutomaton
from ..result import DecodingStats, RoundTrace
from .gate import GateDecision

__all__ = ["CompetenceMarks", "RowState"]

# Per model: which prompt tokens measure competence, and their character offsets.
CompetenceMarks = list[tuple[list[bool], list[tuple[int, int]] | None]]


@dataclass
class RowState:
    """One prompt's text so far, what of it was handed out, and why it finished."""

    text: str = ""
    emitted: int = 0
    new_tokens: int = 0
    finish_reason: str | None = None
    stats: DecodingStats = field(default_factory=DecodingStats)
    trace: list[RoundTrace] | None = None
    gate_decisions: list[GateDecision] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)  # text safe to emit, not yet handed out
    weights: torch.Tensor | None = None  # each model's weight in this prompt's fused scores
    competence: CompetenceMarks | None = None
    constraint: TextAutomaton | None = None  # the language the answer must belong to

    def take_pieces(self) -> list[str]:
        pieces, self.pieces = self.pieces, []
        return pieces
