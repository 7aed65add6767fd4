"""Growing a row's text by a chosen span: stop sequences, the end token, the token budget, and which text is safe
to hand out while a stop sequence could still be forming."""
from __future__ import annotations

from ..backend import Backend
from ..config import FusionConfig
from .candidates import Candidate
from .state import RowState

__all__ = ["append_span"]


def append_span(state: RowState, chosen: Candidate, config: FusionConfig, counter: Backend) -> str:
    """Add the chosen span to the row's text, apply stop conditions (the budget in tokens of `counter`, the first
    model), and return the text now safe to emit."""
    before = len(state.text)
    state.text += chosen.text
    state.new_tokens += len(counter.encode_piece(chosen.text))
    longest = max((len(s) for s in config.stop), default=0)
    search_from = max(0, before - longest + 1)
    if config.stop_after_text:
        text_starts = len(state.text) - len(state.text.lstrip())
        search_from = max(search_from, text_starts) if text_starts < len(state.text) else len(state.text)
    hits = [i for i in (state.text.find(s, search_from) for s in config.stop) if i >= 0]
    if hits:
        state.text, state.finish_reason = state.text[: min(hits)], "stop"
        state.new_tokens = len(counter.encode_piece(state.text))
    elif chosen.ends:
        state.finish_reason = "eos"
    elif state.constraint is not None and state.constraint.finished(state.constraint.walk(state.text)):
        state.finish_reason = "stop"  # the answer is complete: nothing may follow it
    elif state.new_tokens >= config.max_new_tokens or (config.max_rounds and state.stats.rounds >= config.max_rounds):
        state.finish_reason = "length"
        state.text = counter.truncate(state.text, config.max_new_tokens)
        state.new_tokens = len(counter.encode_piece(state.text))
    safe = len(state.text) if state.finish_reason else len(state.text) - _held_back(state.text, config.stop)
    piece, state.emitted = state.text[state.emitted:safe], max(state.emitted, safe)
    return piece


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop sequence."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
