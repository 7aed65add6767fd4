"""Output that must match a regular language (a JSON schema's, or a regular expression), enforced on characters.

Fusion commits text that every member shares, so one character automaton constrains every member whatever its
tokenizer: each round's pooled candidates are cut to their longest prefix the automaton can still complete, and an
answer that runs out of budget is closed with the automaton's shortest completion, so it always parses.
"""
from __future__ import annotations

import functools
import json
from collections import deque
from typing import Any

import interegular
from interegular.fsm import anything_else
from outlines_core.json_schema import build_regex_from_schema

__all__ = ["TextAutomaton", "compile_constraint", "schema_regex"]

# One optional space between JSON tokens (as outlines does by default): no room for runaway whitespace.
_JSON_WHITESPACE = r"[ ]?"
_FILLER = "abcdefghijklmnopqrstuvwxyz0123456789 "


class TextAutomaton:
    """A deterministic automaton over characters, trimmed to the states from which an accepted text is reachable."""

    def __init__(self, pattern: str):
        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as error:  # interegular raises several kinds on a pattern it cannot read
            raise ValueError(f"invalid regex {pattern!r}: {error or type(error).__name__}") from None
        self.pattern, self.initial, self._alphabet = pattern, fsm.initial, fsm.alphabet
        self._accepting = frozenset(fsm.finals)
        self._next = {state: dict(moves) for state, moves in fsm.map.items()}
        self._live = self._states_reaching_acceptance()
        if self.initial not in self._live:
            raise ValueError(f"regex {pattern!r} accepts no text")
        self._spelling = self._character_per_symbol()

    def step(self, state: int | None, char: str) -> int | None:
        """The state after `char`, or None where no accepted text continues this way."""
        if state is None:
            return None
        following = self._next.get(state, {}).get(self._alphabet[char])
        return following if following in self._live else None

    def walk(self, text: str, state: int | None = None) -> int | None:
        state = self.initial if state is None else state
        for char in text:
            state = self.step(state, char)
        return state

    def longest_valid_prefix(self, text: str, state: int) -> tuple[str, int]:
        """The longest prefix of `text` that keeps an accepted completion possible, and the state after it."""
        for i, char in enumerate(text):
            following = self.step(state, char)
            if following is None:
                return text[:i], state
            state = following
        return text, state

    def accepts(self, state: int) -> bool:
        return state in self._accepting

    def finished(self, state: int) -> bool:
        """Accepted, and no character can follow."""
        return self.accepts(state) and not any(s in self._live for s in self._next.get(state, {}).values())

    def shortest_completion(self, state: int) -> str:
        """The fewest characters that take `state` to acceptance (breadth first)."""
        seen, queue = {state: ""}, deque([state])
        while queue:
            current = queue.popleft()
            if current in self._accepting:
                return seen[current]
            for symbol, following in self._next.get(current, {}).items():
                if following in self._live and following not in seen and symbol in self._spelling:
                    seen[following] = seen[current] + self._spelling[symbol]
                    queue.append(following)
        raise AssertionError(f"state {state} is live but reaches no accepting state")  # _live rules this out

    def _states_reaching_acceptance(self) -> frozenset[int]:
        incoming: dict[int, set[int]] = {}
        for state, moves in self._next.items():
            for following in moves.values():
                incoming.setdefault(following, set()).add(state)
        live, queue = set(self._accepting), deque(self._accepting)
        while queue:
            for earlier in incoming.get(queue.popleft(), ()):
                if earlier not in live:
                    live.add(earlier)
                    queue.append(earlier)
        return frozenset(live)

    def _character_per_symbol(self) -> dict[Any, str]:
        """A character for each transition symbol, to spell completions with (a letter, digit or space if it has one,
        else a printable one)."""
        spelling: dict[Any, str] = {}
        chars = [(char, symbol) for char, symbol in self._alphabet._symbol_mapping.items() if char is not anything_else]
        for char, symbol in sorted(chars, key=lambda pair: (pair[0] not in _FILLER, not pair[0].isprintable(), pair[0])):
            spelling.setdefault(symbol, char)
        other = self._alphabet._symbol_mapping.get(anything_else)
        if other is not None:
            free = next((c for c in _FILLER if c not in self._alphabet._symbol_mapping), None)
            if free is not None:
                spelling.setdefault(other, free)
        return spelling


def compile_constraint(json_schema: dict[str, Any] | None, regex: str | None) -> TextAutomaton | None:
    """The automaton of a JSON schema or of a regex; None when neither is set."""
    if json_schema is None and regex is None:
        return None
    return _automaton(schema_regex(json_schema) if json_schema is not None else regex)


def schema_regex(json_schema: dict[str, Any]) -> str:
    """The regex of the JSON texts a schema allows (outlines-core's translation), properties in the schema's order."""
    try:
        schema_text = json.dumps(json_schema)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid json_schema: not JSON-serialisable ({error})") from None
    return _schema_regex(schema_text)


@functools.lru_cache(maxsize=64)
def _schema_regex(schema_text: str) -> str:
    try:
        return build_regex_from_schema(schema_text, whitespace_pattern=_JSON_WHITESPACE)
    except Exception as error:  # outlines-core raises its own error types on schemas it does not support
        raise ValueError(f"invalid json_schema: {error}") from None


@functools.lru_cache(maxsize=32)
def _automaton(pattern: str) -> TextAutomaton:
    return TextAutomaton(pattern)
