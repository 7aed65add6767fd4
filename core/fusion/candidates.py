"""The pooled candidates of one round: every model's spans, deduplicated by their text."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Candidate", "CandidatePool"]


@dataclass
class Candidate:
    """A span of text every model will score; `ends` when it finishes the answer."""

    text: str
    ends: bool
    proposers: list[str] = field(default_factory=list)


class CandidatePool:
    """Candidates keyed by (text, ends), remembering which models proposed each; text that prints nothing is kept
    only when it ends the answer."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, bool], Candidate] = {}

    def add(self, text: str, ends: bool, proposer: str) -> None:
        if not text and not ends:
            return
        candidate = self._by_key.setdefault((text, ends), Candidate(text, ends))
        if proposer not in candidate.proposers:
            candidate.proposers.append(proposer)

    def candidates(self) -> list[Candidate]:
        return list(self._by_key.values())
