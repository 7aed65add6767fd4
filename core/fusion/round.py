"""One prompt's AdaFuse rounds as a coroutine: propose spans per model, pool them, score every candidate under
every model, commit the best one to the shared text."""
from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass

import torch

from ..backend import Backend
from ..config import DecodingMode, FusionConfig
from ..result import CandidateTrace, RoundTrace
from ..runtime.scheduler import Fed, Needs, RowTask, Scheduler
from .candidates import Candidate, CandidatePool
from .constrained import close_constrained, constrained_candidates
from .gate import GateSession
from .proposals import RowProposals, propose_row
from .scoring import chosen_candidate, confident_weights, span_nll
from .state import RowState
from .stopping import append_span
from .token_level import token_candidates, token_scores

logger = logging.getLogger(__name__)

__all__ = ["RoundContext", "rounds"]

Scores = tuple[list[list[float]], list[float]]  # per candidate: each model's NLL, and the fused score


@dataclass
class RoundContext:
    """What every row's rounds share within one decoding call."""

    backends: list[Backend]
    scheduler: Scheduler
    config: FusionConfig
    gate: GateSession | None
    generator: torch.Generator


def rounds(r: int, state: RowState, context: RoundContext) -> RowTask:
    """Row r's rounds until it finishes: yields the scratch tokens it needs run, per model, and is sent the node ids
    they got. A constrained answer that finished unaccepted (budget, stop) is closed."""
    yield from _rounds(r, state, context)
    if state.constraint is not None:
        close_constrained(state, state.constraint, context.backends[0])


def _rounds(r: int, state: RowState, context: RoundContext) -> RowTask:
    config = context.config
    token_level = config.decoding_mode() is DecodingMode.TOKEN_FUSION
    deepest = _deepest_proposal(config)
    while True:
        if min(_room(context, r)) < deepest:
            state.finish_reason = "length"  # the next round's proposals could run past a context window
            return
        found = _token_round(r, state, context) if token_level else (yield from _word_round(r, state, context))
        if found is None:
            state.finish_reason = "length"
            return
        proposals, pool, scores = found
        if not pool:  # every model offered only tokens that print nothing (special or unused vocabulary slots)
            logger.warning("no model proposed any text; ending the generation")
            state.finish_reason = "eos"
            return
        chosen = pool[chosen_candidate(*scores, state.weights, config.veto_margin)]
        _record_round(state, context.backends, proposals, pool, scores, chosen)
        piece = append_span(state, chosen, config, context.backends[0])
        if piece:
            state.pieces.append(piece)
        if state.finish_reason:
            return
        spans = [backend.encode_piece(chosen.text) for backend in context.backends]
        yield from _feed_missing(r, [[span] for span in spans], context)
        position = context.scheduler.position(r)
        for batch, span in zip(context.scheduler.batches, spans):
            batch.commit_row(position, span)


def _deepest_proposal(config: FusionConfig) -> int:
    """The most positions one round's proposals can add beyond a row's committed tokens (plus the end token)."""
    if config.decoding_mode() is DecodingMode.TOKEN_FUSION:
        return 2
    return (config.fixed_span_words or config.max_span_words) * config.max_word_tokens + 1


def _token_round(r: int, state: RowState, context: RoundContext) -> tuple[None, list[Candidate], Scores]:
    position, batches = context.scheduler.position(r), context.scheduler.batches
    pool = token_candidates(context.backends, batches, position, context.config,
                            may_end=state.new_tokens >= context.config.min_new_tokens)
    return None, pool, token_scores(context.backends, batches, position, pool, state.weights)


def _word_round(r: int, state: RowState, context: RoundContext
                ) -> Generator[Needs, Fed, tuple[list[RowProposals], list[Candidate], Scores] | None]:
    """Propose, pool and score one round's spans; None when no candidate fits every model's context window."""
    backends = context.backends
    proposals = yield from _propose(r, state, context)
    pool = CandidatePool()
    for backend, row in zip(backends, proposals):
        for proposal in row.proposals:
            pool.add(backend.decode(proposal.tokens), proposal.ends, backend.name)
    candidates = pool.candidates()
    if state.constraint is not None:
        candidates = constrained_candidates(candidates, state.constraint, state.text, backends, context.scheduler.batches,
                                            context.scheduler.position(r), context.config.num_branches)
    paths = [[backend.encode_piece(c.text) for c in candidates] for backend in backends]
    fitting, paths = _fitting(candidates, paths, _room(context, r))
    if candidates and not fitting:
        return None
    yield from _feed_missing(r, paths, context)
    return proposals, fitting, _score(context, r, fitting, paths, state.weights)


def _room(context: RoundContext, r: int) -> list[int]:
    """Per model, how many more positions row r may take before it reaches that model's context window."""
    position = context.scheduler.position(r)
    return [b.context_window - len(batch.rows[position].ids) for b, batch in zip(context.backends, context.scheduler.batches)]


def _propose(r: int, state: RowState, context: RoundContext) -> Generator[Needs, Fed, list[RowProposals]]:
    """Run every model's proposal coroutine for row r side by side; return their proposals."""
    scheduler, position = context.scheduler, context.scheduler.position(r)
    budget = context.config.max_new_tokens - state.new_tokens
    min_tokens = max(0, context.config.min_new_tokens - state.new_tokens)
    runs = {
        m: propose_row(backend, batch.root_logprobs[position], batch.root_hidden[position] if batch.keep_hidden else None,
                       context.config, budget, context.generator, context.gate, m, min_tokens)
        for m, (backend, batch) in enumerate(zip(context.backends, scheduler.batches))
    }
    results: dict[int, RowProposals] = {}
    needs: Needs = {}
    for m, run in runs.items():
        try:
            needs[m] = next(run)
        except StopIteration as done:
            results[m] = done.value
    while needs:
        fed = yield needs
        position = scheduler.position(r)
        for m in list(needs):
            batch, nodes = scheduler.batches[m], fed[m]
            feedback = (
                nodes,
                torch.stack([batch.logprobs(position, n) for n in nodes]),
                torch.stack([batch.rows[position].node_hidden[n] for n in nodes]) if batch.keep_hidden else None,
            )
            try:
                needs[m] = runs[m].send(feedback)
            except StopIteration as done:
                results[m] = done.value
                del needs[m]
    return [results[m] for m in range(len(context.backends))]


def _feed_missing(r: int, paths: list[list[list[int]]], context: RoundContext) -> Generator[Needs, Fed, None]:
    """Yield the tokens of `paths` (per model) not yet in row r's trees, if any, to be run at the next step."""
    position = context.scheduler.position(r)
    needs = {m: batch.missing(position, model_paths) for m, (batch, model_paths) in enumerate(zip(context.scheduler.batches, paths))}
    needs = {m: request for m, request in needs.items() if request}
    if needs:
        yield needs


def _fitting(pool: list[Candidate], paths: list[list[list[int]]], room: list[int]) -> tuple[list[Candidate], list[list[list[int]]]]:
    """The candidates (and their per-model token paths) that every model can score within its context window."""
    keep = [i for i, c in enumerate(pool) if all(len(p[i]) + c.ends <= space for p, space in zip(paths, room))]
    return [pool[i] for i in keep], [[p[i] for i in keep] for p in paths]


def _score(context: RoundContext, r: int, pool: list[Candidate], paths: list[list[list[int]]], weights: torch.Tensor) -> Scores:
    """Each model's NLL of every candidate of row r (their tokens are in every tree by now), normalised as
    configured, and the weighted fused score. A lone candidate needs no scoring."""
    position, normalization = context.scheduler.position(r), context.config.span_normalization
    per_model = [
        [span_nll(backend, batch, position, tokens, c.text, c.ends, normalization) if len(pool) > 1 else 0.0
         for tokens, c in zip(model_paths, pool)]
        for backend, batch, model_paths in zip(context.backends, context.scheduler.batches, paths)
    ]
    nll = [[per_model[m][c] for m in range(len(context.backends))] for c in range(len(pool))]
    weights = confident_weights(weights, nll, context.config.confidence_sharpness)
    return nll, [float(torch.tensor(n) @ weights) for n in nll]


def _record_round(state: RowState, backends: list[Backend], proposals: list[RowProposals] | None,
                  pool: list[Candidate], scores: Scores, chosen: Candidate) -> None:
    state.stats.rounds += 1
    for proposal in proposals or []:
        state.gate_decisions.extend(proposal.decisions)
    state.stats.words_per_round.append(len(chosen.text.split()))
    state.stats.explorations += sum(p.explored for p in proposals or [])
    if state.trace is not None:
        names = [b.name for b in backends]
        state.trace.append(RoundTrace(
            index=state.stats.rounds,
            margins={n: p.margin for n, p in zip(names, proposals or [])},
            explored={n: p.explored for n, p in zip(names, proposals or [])},
            candidates=[
                CandidateTrace(c.text, c.ends, c.proposers, dict(zip(names, scores[0][i])), scores[1][i])
                for i, c in enumerate(pool)
            ],
            chosen=chosen.text,
        ))
