"""The AdaFuse decoding loop: propose words per model, pool, score across models, commit the best span."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import torch

from .adapters import SamplingChoice, SequenceAdapter, TokenAdapter, _Adapter
from .adaptive import AdaptiveSampler, majority_index, prompt_embeddings
from .backend import ModelBackend
from .config import FusionConfig
from .fusion_gate import FusionGate, GateDecision, GateSession
from .kv_tree import TreeBatch
from .models import DEFAULT_ENSEMBLE
from .prompts import Prompt, normalize_prompt, normalize_prompts
from .proposals import RowProposals, propose_row
from .result import CandidateTrace, DecodingStats, GenerationResult, RoundTrace
from .scoring import competence_weights, nats_per_char, scored_tokens
from .streaming import in_worker_thread

logger = logging.getLogger(__name__)

__all__ = ["AdaFuse"]

# Waiting prompts join a running batch once this share of its slots is free, or as soon as all of them fit: each
# join costs a prefill forward and a cache copy, so joining in groups beats joining one by one, but the last group
# has nobody to wait for (benchmarks/bench_decoding.py).
_JOIN_AT = 0.5


@dataclass
class _Candidate:
    text: str
    ends: bool
    proposers: list[str]


@dataclass
class _RowState:
    """Decoding state of one prompt, shared by all models (the text is the source of truth)."""

    text: str = ""
    emitted: int = 0
    new_tokens: int = 0
    finish_reason: str | None = None
    stats: DecodingStats = field(default_factory=DecodingStats)
    trace: list[RoundTrace] | None = None
    gate_decisions: list[GateDecision] = field(default_factory=list)
    task: Generator | None = None  # the row's rounds, a coroutine driven by the loop
    pieces: list[str] = field(default_factory=list)  # text safe to emit, not yet handed out
    weights: torch.Tensor | None = None  # each model's weight in this prompt's fused scores
    competence: list[tuple[list[bool], list[tuple[int, int]] | None]] | None = None  # per model: tokens scored, offsets

    def take_pieces(self) -> list[str]:
        pieces, self.pieces = self.pieces, []
        return pieces


@dataclass
class _LoopContext:
    """What every row's coroutine shares within one `_decode` call."""

    batches: list[TreeBatch]
    active: list[int]
    config: FusionConfig
    gate: GateSession | None
    generator: torch.Generator
    weights: torch.Tensor  # the prior (model_weights, normalised); rows scale it by competence


class AdaFuse:
    """Adaptive word-level ensemble of causal LMs (AdaFuse, arXiv 2601.06022).

    Every round each model proposes whole-word spans (committing up to M words greedily when confident,
    branching on its top-B first tokens when not); every model scores every pooled candidate by mean NLL
    under its own tokenizer; the candidate with the lowest weighted mean NLL extends the shared text.
    """

    def __init__(self, backends: Sequence[ModelBackend], config: FusionConfig | None = None):
        if not backends:
            raise ValueError("AdaFuse needs at least one model")
        self.backends = list(backends)
        self._lock = threading.Lock()
        self._policies: dict[tuple[str, str], _Adapter] = {}
        self.config = self.check_config(config or FusionConfig())

    @classmethod
    def from_pretrained(
        cls,
        models: Sequence[str] = DEFAULT_ENSEMBLE,
        config: FusionConfig | None = None,
        *,
        device_map: str | dict | None = None,
        dtype: str | torch.dtype | None = None,
        reuse_prompt_prefix: bool = True,
        **config_overrides: Any,
    ) -> "AdaFuse":
        """Load models by embedded name, Hugging Face id or local folder (defaults: the embedded pair)."""
        if isinstance(models, str):
            models = [models]
        backends = [
            ModelBackend.from_pretrained(m, device_map=device_map, dtype=dtype, reuse_prompt_prefix=reuse_prompt_prefix)
            for m in models
        ]
        return cls(backends, (config or FusionConfig()).update(**config_overrides))

    @property
    def model_names(self) -> list[str]:
        return [b.name for b in self.backends]

    @property
    def context_window(self) -> int:
        return min(b.context_window for b in self.backends)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompt: Prompt | list[Prompt],
        *,
        trace: bool = False,
        max_batch_size: int | None = None,
        gate: GateSession | None = None,
        **overrides: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Fused completion of one prompt (str or chat messages) or of a list of prompts decoded as a batch.

        With `max_batch_size`, at most that many prompts decode together and the next prompt joins as soon as
        one finishes (continuous batching), so short answers do not wait for the longest one.
        `gate` runs a fusion gate session (for training; to decode with a trained gate set `fusion_gate`).
        Keyword overrides replace `FusionConfig` fields for this call (e.g. `tau_delta=0.5, stop=["\\n"]`).
        """
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        prompts, single = normalize_prompts(prompt)
        results: list[GenerationResult | None] = [None] * len(prompts)
        for event in self._decode(prompts, self._call_config(overrides), trace, max_batch_size, gate):
            if isinstance(event, tuple) and isinstance(event[1], GenerationResult):
                results[event[0]] = event[1]
        return results[0] if single else results

    def stream(self, prompt: Prompt, *, trace: bool = False, **overrides: Any) -> Iterator[str | GenerationResult]:
        """Yield text pieces as rounds commit them, then the final `GenerationResult`.

        Text that could be the start of a stop sequence is held back until it is known not to be one. The decode
        runs in a worker thread: a stream left unread does not block other calls, and closing it cancels it.
        """
        events = self._decode([normalize_prompt(prompt)], self._call_config(overrides), trace)
        with closing(in_worker_thread(events)) as pieces:
            for _, piece in pieces:
                if isinstance(piece, GenerationResult) or piece:
                    yield piece

    def check_prompt(self, prompt: Prompt, **overrides: Any) -> None:
        """Raise the ValueError or TypeError that `generate(prompt, **overrides)` would raise for this prompt
        (malformed, empty, or too long for a model's context window), without decoding anything."""
        self._encode([normalize_prompt(prompt)], self._call_config(overrides))

    def _call_config(self, overrides: dict[str, Any]) -> FusionConfig:
        return self.check_config(self.config.update(**overrides))

    def check_config(self, config: FusionConfig) -> FusionConfig:
        """Validate `config` for these models, loading its fusion gate if it names one; return it."""
        config.validate(len(self.backends))
        vocab = min(b.vocab_size for b in self.backends)
        for name in ("num_branches", "token_top_k"):
            if getattr(config, name) > vocab:
                raise ValueError(f"invalid {name}={getattr(config, name)}: above the smallest vocabulary of these "
                                 f"models ({vocab} tokens)")
        self._gate_session(config)
        self._sampling_policies(config)
        return config

    # ------------------------------------------------------------------ the loop
    def _decode(
        self,
        prompts: list[Prompt],
        config: FusionConfig,
        trace: bool,
        max_batch_size: int | None = None,
        gate: GateSession | None = None,
    ) -> Iterator[tuple[int, str | GenerationResult]]:
        """Every prompt runs its own rounds as a coroutine (`_rounds`); each step runs one forward per model over
        whatever scratch tokens every row needs next, whichever phase of its round a row is in, so rows never
        wait for each other's rounds."""
        if config.samples_adaptively:
            yield from self._sample(prompts, config, max_batch_size)
            return
        gate = gate or self._gate_session(config)
        with self._lock:
            started = time.perf_counter()
            for backend in self.backends:
                backend.reset_counters()
            encoded = self._encode(prompts, config)
            rows = [_RowState(trace=[] if trace else None) for _ in prompts]
            waiting, active = deque(range(len(prompts))), []  # active: row index of each batch position
            batches: list[TreeBatch] = []
            context = _LoopContext(
                batches, active, config, gate,
                torch.Generator(device=self.backends[0].model.device).manual_seed(config.seed),
                torch.tensor(config.model_weights or [1.0] * len(self.backends)),
            )
            context.weights = context.weights / context.weights.sum()
            needs: dict[int, dict[int, list[tuple[int, int]]]] = {}
            fed: dict[int, dict[int, list[int]]] = {}
            capacity = max_batch_size or len(prompts)
            while active or waiting:
                free = capacity - len(active)
                if waiting and free > 0 and free >= min(len(waiting), _JOIN_AT * capacity):
                    joining = [waiting.popleft() for _ in range(min(len(waiting), free))]
                    scored = [None] * len(self.backends)
                    if self._uses_competence(config):
                        for r in joining:
                            rows[r].competence = self._competence_tokens(prompts[r])
                        scored = [[rows[r].competence[m][0] for r in joining] for m in range(len(self.backends))]
                    self._join(batches, [[ids[r] for r in joining] for ids in encoded], keep_hidden=gate is not None,
                               scored=scored)
                    active += joining
                    for r in joining:
                        rows[r].weights = self._row_weights(rows[r], active.index(r), context)
                        rows[r].stats.model_weights = dict(zip(self.model_names, rows[r].weights.tolist()))
                        rows[r].task = self._rounds(r, rows[r], context)
                finished = []
                for r in active:
                    try:
                        needs[r] = rows[r].task.send(fed.get(r))
                    except StopIteration:
                        finished.append(r)
                    yield from ((r, piece) for piece in rows[r].take_pieces())
                self._retire(finished, rows, context)
                fed = {r: {} for r in active}
                for m, batch in enumerate(batches):
                    requests = [needs[r].get(m, []) for r in active]
                    if any(requests):
                        for r, request, nodes in zip(active, requests, batch.feed(requests)):
                            if request:
                                fed[r][m] = nodes
            elapsed = time.perf_counter() - started
            counters = [b.reset_counters() for b in self.backends]
            for r, state in enumerate(rows):
                state.stats.wall_time_s = elapsed
                state.stats.batch_size = len(prompts)
                state.stats.new_tokens = state.new_tokens
                state.stats.forward_passes = {b.name: c["forward_passes"] for b, c in zip(self.backends, counters)}
                state.stats.tokens_processed = {b.name: c["tokens"] for b, c in zip(self.backends, counters)}
                if gate is not None and gate.sample:
                    gate.decisions[r] = state.gate_decisions
                if state.emitted < len(state.text):
                    yield r, state.text[state.emitted:]
                yield r, GenerationResult(state.text, state.finish_reason, state.stats, state.trace)

    def _uses_competence(self, config: FusionConfig) -> bool:
        return config.scoring == "competence" and len(self.backends) > 1

    def _competence_tokens(self, prompt: Prompt) -> list[tuple[list[bool], list[tuple[int, int]] | None]]:
        """Per model, which of the prompt's tokens measure competence (so the prefill scores only those) and their
        character offsets."""
        marks = []
        for backend in self.backends:
            text = backend.render(prompt)
            offsets = backend.prompt_offsets(text)
            marks.append((scored_tokens(text, offsets), offsets))
        return marks

    def _row_weights(self, state: _RowState, position: int, context: _LoopContext) -> torch.Tensor:
        """The weights of one prompt's fused scores: the prior, scaled by each model's competence on the prompt."""
        if state.competence is None:
            return context.weights
        nats = [nats_per_char(batch.rows[position].prompt_nll or [], scored, offsets)
                for batch, (scored, offsets) in zip(context.batches, state.competence)]
        return competence_weights(context.weights, nats, context.config.competence_sharpness)

    def _retire(self, finished: list[int], rows: list[_RowState], context: _LoopContext) -> None:
        """Drop finished rows from every batch (keeping the forward passes each took part in) and reclaim dead
        cache columns when they pile up."""
        keep = [position for position, r in enumerate(context.active) if r not in finished]
        for backend, batch in zip(self.backends, context.batches):
            for position, r in enumerate(context.active):
                if r in finished:
                    rows[r].stats.row_forward_passes[backend.name] = batch.rows[position].forwards
            batch.compact(keep)
        context.active[:] = [r for r in context.active if r not in finished]

    def _rounds(self, r: int, state: _RowState, context: _LoopContext) -> Generator[dict[int, list[tuple[int, int]]], dict[int, list[int]], None]:
        """One prompt's rounds, as a coroutine: it yields the scratch tokens it needs run, per model, and is sent
        the node ids they got; it returns when the prompt is finished."""
        config, batches = context.config, context.batches
        while True:
            if min(self._room(context, r)) < _deepest_proposal(config):
                state.finish_reason = "length"  # the next round's proposals could run past a context window
                return
            if config.unit == "token":
                proposals = None
                pool = self._token_pool(batches, context.active.index(r), config)
                scores = self._token_scores(batches, context.active.index(r), pool, state.weights)
            else:
                proposals = yield from self._propose(r, state, context)
                pool = self._pool(proposals)
                paths = [[backend.encode_piece(c.text) for c in pool] for backend in self.backends]
                fitting, paths = _fitting(pool, paths, self._room(context, r))
                if pool and not fitting:
                    state.finish_reason = "length"
                    return
                pool = fitting
                yield from self._feed_missing(r, paths, context)
                scores = self._score(batches, context.active.index(r), pool, paths, state.weights, config.span_normalization)
            if not pool:  # every model offered only tokens that print nothing (special or unused vocabulary slots)
                logger.warning("no model proposed any text; ending the generation")
                state.finish_reason = "eos"
                return
            chosen = pool[min(range(len(pool)), key=lambda c: scores[1][c])]
            self._record_round(state, proposals, pool, scores, chosen)
            piece = self._append(state, chosen, config)
            if piece:
                state.pieces.append(piece)
            if state.finish_reason:
                return
            spans = [backend.encode_piece(chosen.text) for backend in self.backends]
            yield from self._feed_missing(r, [[span] for span in spans], context)
            position = context.active.index(r)
            for batch, span in zip(batches, spans):
                batch.commit_row(position, span)

    def _room(self, context: _LoopContext, r: int) -> list[int]:
        """Per model, how many more positions row r may take before it reaches that model's context window."""
        position = context.active.index(r)
        return [b.context_window - len(batch.rows[position].ids) for b, batch in zip(self.backends, context.batches)]

    def _propose(self, r: int, state: _RowState, context: _LoopContext) -> Generator[dict, dict, list[RowProposals]]:
        """Run every model's proposal coroutine for row r side by side; return their proposals."""
        position = context.active.index(r)
        budget = context.config.max_new_tokens - state.new_tokens
        runs = {
            m: propose_row(backend, batch.root_logprobs[position], batch.root_hidden[position] if batch.keep_hidden else None,
                           context.config, budget, context.generator, context.gate, m)
            for m, (backend, batch) in enumerate(zip(self.backends, context.batches))
        }
        results: dict[int, RowProposals] = {}
        needs: dict[int, list[tuple[int, int]]] = {}
        for m, run in runs.items():
            try:
                needs[m] = next(run)
            except StopIteration as done:
                results[m] = done.value
        while needs:
            fed = yield needs
            position = context.active.index(r)
            for m in list(needs):
                batch = context.batches[m]
                nodes = fed[m]
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
        return [results[m] for m in range(len(self.backends))]

    @staticmethod
    def _feed_missing(r: int, paths: list[list[list[int]]], context: _LoopContext) -> Generator[dict, dict, None]:
        """Yield the tokens of `paths` (per model) not yet in row r's trees, if any, to be run at the next step."""
        position = context.active.index(r)
        needs = {m: batch.missing(position, model_paths) for m, (batch, model_paths) in enumerate(zip(context.batches, paths))}
        needs = {m: request for m, request in needs.items() if request}
        if needs:
            yield needs

    def _gate_session(self, config: FusionConfig) -> GateSession | None:
        """The learned gate named by `config.fusion_gate` (loaded once), checked against these models."""
        if config.fusion_gate is None or config.unit == "token":
            return None
        gate = self._policy(FusionGate, config.fusion_gate)
        sizes = [_hidden_size(b) for b in self.backends]
        if gate.hidden_sizes != sizes:
            raise ValueError(
                f"fusion gate {config.fusion_gate!r} was trained for models {gate.model_names or gate.hidden_sizes} "
                f"(hidden sizes {gate.hidden_sizes}), not these ({self.model_names}, hidden sizes {sizes})"
            )
        return GateSession(gate)

    def _sampling_policies(self, config: FusionConfig) -> tuple[ModelBackend, TokenAdapter | None, SequenceAdapter | None] | None:
        """The decoding adapters named by `config` (loaded once) and the one of these models they were trained for."""
        if not config.samples_adaptively:
            return None
        token = self._policy(TokenAdapter, config.token_adapter) if config.token_adapter else None
        sequence = self._policy(SequenceAdapter, config.sequence_adapter) if config.sequence_adapter else None
        bases = sorted({a.base_model for a in (token, sequence) if a is not None})
        if len(bases) > 1:
            raise ValueError(f"token_adapter and sequence_adapter were trained for different models: {bases}")
        backend = next((b for b in self.backends if b.name == bases[0]), None)
        if backend is None:
            raise ValueError(f"the decoding adapter was trained for model {bases[0]!r}, which is not one of {self.model_names}")
        sizes = ([token.hidden_size] if token else []) + ([sequence.embed_dim] if sequence else [])
        if any(size != _hidden_size(backend) for size in sizes):
            raise ValueError(f"the decoding adapter's input size {sizes} does not match model {backend.name!r} "
                             f"(hidden size {_hidden_size(backend)})")
        return backend, token, sequence

    def _policy(self, kind: type[_Adapter], name: str) -> _Adapter:
        policy = self._policies.get((kind.kind, name))
        if policy is None:
            policy = self._policies[(kind.kind, name)] = kind.from_name(name)
        return policy

    def _sample(self, prompts: list[Prompt], config: FusionConfig, max_batch_size: int | None) -> Iterator[tuple[int, str | GenerationResult]]:
        """Adaptive sampling (arXiv 2603.09065) with the adapters' model: the sequence adapter picks each prompt's
        sampling configuration, the token adapter each step's temperature; `num_samples` samples are majority-voted."""
        backend, token, sequence = self._sampling_policies(config)
        with self._lock:
            started = time.perf_counter()
            backend.reset_counters()
            self._encode_for(backend, prompts, config)
            texts = [backend.render(p) for p in prompts]
            if sequence is not None:
                choices = [sequence.choose(e, config.num_samples) for e in prompt_embeddings(backend, texts)]
            else:
                choices = [SamplingChoice(0.0, config.top_k, config.top_p, config.min_p)] * len(texts)
            rollouts = AdaptiveSampler(backend, token).sample(
                texts, choice=choices, max_new_tokens=config.max_new_tokens, stop=tuple(config.stop),
                generator=torch.Generator(device=backend.model.device).manual_seed(config.seed),
                samples_per_prompt=config.num_samples,
                max_batch_rows=max_batch_size and max_batch_size * config.num_samples,
            )
            counters = backend.reset_counters()
            elapsed = time.perf_counter() - started
        for r in range(len(prompts)):
            samples = rollouts[r * config.num_samples:(r + 1) * config.num_samples]
            voted = samples[majority_index([s.text for s in samples])]
            stats = DecodingStats(
                rounds=max(s.new_tokens for s in samples), new_tokens=voted.new_tokens, batch_size=len(prompts),
                forward_passes={backend.name: counters["forward_passes"]},
                tokens_processed={backend.name: counters["tokens"]}, wall_time_s=elapsed,
            )
            if voted.text:
                yield r, voted.text
            yield r, GenerationResult(voted.text, voted.finish_reason, stats)

    def _join(self, batches: list[TreeBatch], encoded: list[list[list[int]]], keep_hidden: bool = False,
              scored: list[list[list[bool]] | None] | None = None) -> None:
        """Prefill new prompts (token ids per model) and add them as rows to the running batches (`scored`: per
        model, per prompt, the prompt tokens whose NLL competence scoring reads)."""
        scored = scored or [None] * len(self.backends)
        joining = [backend.start(ids, keep_hidden, marks) for backend, ids, marks in zip(self.backends, encoded, scored)]
        if not batches:
            batches.extend(joining)
            return
        for batch, new in zip(batches, joining):
            batch.extend(new)

    def _start(self, prompts: list[Prompt], config: FusionConfig) -> list[TreeBatch]:
        """Encode prompts for each model and prefill every model's cache with all of them."""
        return [backend.start(ids) for backend, ids in zip(self.backends, self._encode(prompts, config))]

    def _encode(self, prompts: list[Prompt], config: FusionConfig) -> list[list[list[int]]]:
        """Render and encode each prompt for each model (per model, per prompt), checking it before any work."""
        return [self._encode_for(backend, prompts, config) for backend in self.backends]

    @staticmethod
    def _encode_for(backend: ModelBackend, prompts: list[Prompt], config: FusionConfig) -> list[list[int]]:
        """One model's token ids of each (normalised) prompt; a too long prompt raises, naming the model."""
        encoded = []
        for prompt in prompts:
            ids = backend.encode_prompt(backend.render(prompt))
            if len(ids) + config.max_new_tokens > backend.context_window:
                raise ValueError(
                    f"prompt of {len(ids)} tokens plus max_new_tokens={config.max_new_tokens} exceeds the "
                    f"context window of model {backend.name!r} ({backend.context_window} tokens)"
                )
            encoded.append(ids)
        return encoded

    def _pool(self, proposals: list[RowProposals]) -> list[_Candidate]:
        """All models' candidate spans for one row, deduplicated by text (and whether they end)."""
        pool: dict[tuple[str, bool], _Candidate] = {}
        for backend, row in zip(self.backends, proposals):
            for proposal in row.proposals:
                text = backend.decode(proposal.tokens)
                if not text and not proposal.ends:
                    continue
                candidate = pool.setdefault((text, proposal.ends), _Candidate(text, proposal.ends, []))
                if backend.name not in candidate.proposers:
                    candidate.proposers.append(backend.name)
        return list(pool.values())

    def _token_pool(self, batches: list[TreeBatch], position: int, config: FusionConfig) -> list[_Candidate]:
        """Token-level baseline: every model's top-k next tokens for one row, pooled by their text."""
        pool: dict[tuple[str, bool], _Candidate] = {}
        for backend, batch in zip(self.backends, batches):
            for token in batch.root_logprobs[position].topk(config.token_top_k).indices.tolist():
                ends = token in backend.end_ids
                text = "" if ends else backend.decode([token])
                if text or ends:
                    candidate = pool.setdefault((text, ends), _Candidate(text, ends, []))
                    if backend.name not in candidate.proposers:
                        candidate.proposers.append(backend.name)
        return list(pool.values())

    def _token_scores(self, batches: list[TreeBatch], position: int, pool: list[_Candidate], weights: torch.Tensor):
        """Each model's log-probability of each pooled token text (mapped through its own tokenizer's first
        token), and the fused score: minus the log of the weighted mean probability."""
        nll = []
        for candidate in pool:
            row = []
            for backend, batch in zip(self.backends, batches):
                logprobs = batch.root_logprobs[position]
                tokens = backend.encode_piece(candidate.text)
                row.append(-float(backend.end_logprob(logprobs) if candidate.ends else logprobs[tokens[0]]))
            nll.append(row)
        fused = [-float(torch.log(torch.exp(-torch.tensor(n)) @ weights)) for n in nll]
        return nll, fused

    def score(self, prompt: Prompt, continuations: list[str]) -> list[list[float]]:
        """Each model's mean token NLL of each continuation of `prompt` (one row per continuation).

        The sample-level baseline uses this to pick, among whole answers, the one the ensemble finds likeliest.
        """
        if any(not text for text in continuations):
            raise ValueError("continuations to score must be non-empty strings")
        with self._lock:
            for backend in self.backends:
                backend.reset_counters()  # left counting this call's work, for callers that report it
            batches = self._start([normalize_prompt(prompt)], self.config)
            per_model = []
            for backend, batch in zip(self.backends, batches):
                paths = [backend.encode_piece(text) for text in continuations]
                batch.ensure_paths([paths])
                per_model.append([_mean_nll(backend, batch, 0, path, False) for path in paths])
        return [list(row) for row in zip(*per_model)]

    def _score(self, batches: list[TreeBatch], position: int, pool: list[_Candidate], paths: list[list[list[int]]],
               weights: torch.Tensor, normalization: str) -> tuple[list[list[float]], list[float]]:
        """Each model's NLL of every candidate of one row (their tokens are in every tree by now), normalised as
        configured, and the weighted fused score. A lone candidate needs no scoring."""
        per_model = [
            [_span_nll(backend, batch, position, tokens, c, normalization) if len(pool) > 1 else 0.0
             for tokens, c in zip(model_paths, pool)]
            for backend, batch, model_paths in zip(self.backends, batches, paths)
        ]
        nll = [[per_model[m][c] for m in range(len(self.backends))] for c in range(len(pool))]
        return nll, [float(torch.tensor(n) @ weights) for n in nll]

    def _record_round(self, state: _RowState, proposals: list[RowProposals] | None, pool, scores, chosen: _Candidate) -> None:
        state.stats.rounds += 1
        for proposal in proposals or []:
            state.gate_decisions.extend(proposal.decisions)
        state.stats.words_per_round.append(len(chosen.text.split()))
        state.stats.explorations += sum(p.explored for p in proposals or [])
        if state.trace is not None:
            names = [b.name for b in self.backends]
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

    def _append(self, state: _RowState, chosen: _Candidate, config: FusionConfig) -> str:
        """Add the chosen span to the row's text, apply stop conditions, and return the text now safe to emit."""
        before = len(state.text)
        state.text += chosen.text
        state.new_tokens += len(self.backends[0].encode_piece(chosen.text))
        longest = max((len(s) for s in config.stop), default=0)
        search_from = max(0, before - longest + 1)
        if config.stop_after_text:
            text_starts = len(state.text) - len(state.text.lstrip())
            search_from = max(search_from, text_starts) if text_starts < len(state.text) else len(state.text)
        hits = [i for i in (state.text.find(s, search_from) for s in config.stop) if i >= 0]
        if hits:
            state.text, state.finish_reason = state.text[: min(hits)], "stop"
        elif chosen.ends:
            state.finish_reason = "eos"
        elif state.new_tokens >= config.max_new_tokens or (config.max_rounds and state.stats.rounds >= config.max_rounds):
            state.finish_reason = "length"
            state.text = self._truncate(state.text, config.max_new_tokens)
            state.new_tokens = len(self.backends[0].encode_piece(state.text))
        safe = len(state.text) if state.finish_reason else len(state.text) - _held_back(state.text, config.stop)
        piece, state.emitted = state.text[state.emitted:safe], max(state.emitted, safe)
        return piece

    def _truncate(self, text: str, max_tokens: int) -> str:
        """Cut text to at most max_tokens tokens of the first model, as transformers' generate would."""
        ids = self.backends[0].encode_piece(text)
        if len(ids) <= max_tokens:
            return text
        cut = self.backends[0].decode(ids[:max_tokens])
        while cut.endswith("\ufffd") and "\ufffd" not in text:  # the cut split a character's bytes: drop it whole
            max_tokens -= 1
            cut = self.backends[0].decode(ids[:max_tokens])
        return cut


def _span_nll(backend: ModelBackend, batch: TreeBatch, row: int, tokens: list[int], candidate: _Candidate,
              normalization: str) -> float:
    """A candidate's NLL under one model, per token (the paper), per character (the same unit for every tokenizer)
    or in total (the joint probability of the span); the end token counts as one of each."""
    total = _total_nll(backend, batch, row, tokens, candidate.ends)
    per = {"token": len(tokens), "char": len(candidate.text), "total": 0}[normalization] + candidate.ends
    return total / max(per, 1)


def _mean_nll(backend: ModelBackend, batch: TreeBatch, row: int, tokens: list[int], ends: bool) -> float:
    """Length-normalised NLL of a span (plus the end token when it ends) under this model, given the prefix."""
    return _total_nll(backend, batch, row, tokens, ends) / (len(tokens) + ends)


def _total_nll(backend: ModelBackend, batch: TreeBatch, row: int, tokens: list[int], ends: bool) -> float:
    """NLL of a span (plus the end token when it ends) under this model, given the prefix."""
    nodes = batch.path_nodes(row, tokens)
    parents = [-1] + nodes[:-1]
    total = sum(float(batch.logprobs(row, p)[t]) for p, t in zip(parents, tokens))
    if ends:
        total += float(backend.end_logprob(batch.logprobs(row, nodes[-1] if nodes else -1)))
    return -total


def _deepest_proposal(config: FusionConfig) -> int:
    """The most positions one round's proposals can add beyond a row's committed tokens (plus the end token)."""
    if config.unit == "token":
        return 2
    return (config.fixed_span_words or config.max_span_words) * config.max_word_tokens + 1


def _fitting(pool: list[_Candidate], paths: list[list[list[int]]], room: list[int]) -> tuple[list[_Candidate], list[list[list[int]]]]:
    """The candidates (and their per-model token paths) that every model can score within its context window."""
    keep = [i for i, c in enumerate(pool) if all(len(p[i]) + c.ends <= space for p, space in zip(paths, room))]
    return [pool[i] for i in keep], [[p[i] for i in keep] for p in paths]


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop sequence."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _hidden_size(backend: ModelBackend) -> int:
    return backend.model.config.get_text_config().hidden_size

