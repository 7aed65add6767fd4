"""A round's candidates under an output constraint: each cut to the longest prefix the automaton can still
complete, with each model's most likely valid tokens as a fallback, and the closing text an unfinished answer gets."""
from __future__ import annotations

import torch

from ..backend import Backend
from ..chat import Chat
from ..config import FusionConfig
from ..constraints import TextAutomaton, compile_constraint
from ..prompts import Prompt
from ..runtime.token_tree import TokenTree
from .candidates import Candidate, CandidatePool
from .state import RowState

__all__ = ["row_constraint", "constrained_candidates", "close_constrained"]

# How many of a model's most likely next tokens the fallback looks through for ones that continue validly.
_FALLBACK_SCAN = 512


def row_constraint(prompt: Prompt, config: FusionConfig) -> TextAutomaton | None:
    """What a prompt's answer must match: the call's json_schema or regex, else a chat's forced tool call."""
    pattern = prompt.reply_pattern if isinstance(prompt, Chat) else None
    return compile_constraint(config.json_schema, config.regex) or compile_constraint(None, pattern)


def constrained_candidates(candidates: list[Candidate], automaton: TextAutomaton, text: str, backends: list[Backend],
                           batches: list[TokenTree], position: int, per_model: int) -> list[Candidate]:
    """The candidates as far as they keep the answer completable (an end only where the text so far is accepted).
    When none is left, each model's `per_model` most likely first tokens that continue validly; failing those,
    the first character of the shortest completion."""
    state = automaton.walk(text)
    pool = CandidatePool()
    for candidate in candidates:
        prefix, after = automaton.longest_valid_prefix(candidate.text, state)
        ends = candidate.ends and prefix == candidate.text and automaton.accepts(after)
        for proposer in candidate.proposers:
            pool.add(prefix, ends, proposer)
    if kept := pool.candidates():
        return kept
    for backend, batch in zip(backends, batches):
        found = 0
        for token in torch.argsort(batch.root_logprobs[position], descending=True)[:_FALLBACK_SCAN].tolist():
            prefix, _ = automaton.longest_valid_prefix(backend.decode([token]), state)
            if prefix:
                pool.add(prefix, False, backend.name)
                found += 1
                if found == per_model:
                    break
    if kept := pool.candidates():
        return kept
    completion = automaton.shortest_completion(state)
    return [Candidate(completion[:1], not completion, ["constraint"])]


def close_constrained(state: RowState, automaton: TextAutomaton, counter: Backend) -> None:
    """Append the shortest text that makes a finished row's answer match (it ran out of budget or hit a stop)."""
    completion = automaton.shortest_completion(automaton.walk(state.text))
    if completion:
        state.text += completion
        state.new_tokens = len(counter.encode_piece(state.text))
    if state.emitted < len(state.text):
        state.pieces.append(state.text[state.emitted:])
        state.emitted = len(state.text)
