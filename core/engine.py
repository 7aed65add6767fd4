"""The AdaFuse decoding loop: propose words per model, pool, score across models, commit the best span."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .backend import ModelBackend
from .chat import Message
from .config import FusionConfig
from .fusion_gate import FusionGate, GateDecision, GateSession, load_gate
from .kv_tree import TreeBatch
from .proposals import RowProposals, propose
from .result import CandidateTrace, DecodingStats, GenerationResult, RoundTrace

logger = logging.getLogger(__name__)

__all__ = ["AdaFuse"]

Prompt = str | list[Message]
# Waiting prompts join a running batch once this share of its slots is free: each join costs a prefill
# forward and a cache copy, so joining in groups beats joining one by one (benchmarks/bench_decoding.py).
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
        self._gates: dict[str, FusionGate] = {}
        self.config = self.check_config(config or FusionConfig())

    @classmethod
    def from_pretrained(
        cls,
        models: Sequence[str] = ("smollm2-135m", "gemma3-270m"),
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
        single = isinstance(prompt, str) or _is_messages(prompt)
        prompts = [prompt] if single else list(prompt)
        results: list[GenerationResult | None] = [None] * len(prompts)
        for event in self._decode(prompts, self._call_config(overrides), trace, max_batch_size, gate):
            if isinstance(event, tuple) and isinstance(event[1], GenerationResult):
                results[event[0]] = event[1]
        return results[0] if single else results

    def stream(self, prompt: Prompt, *, trace: bool = False, **overrides: Any) -> Iterator[str | GenerationResult]:
        """Yield text pieces as rounds commit them, then the final `GenerationResult`.

        Text that could be the start of a stop sequence is held back until it is known not to be one.
        """
        for event in self._decode([prompt], self._call_config(overrides), trace):
            piece = event[1]
            if isinstance(piece, GenerationResult) or piece:
                yield piece

    def _call_config(self, overrides: dict[str, Any]) -> FusionConfig:
        return self.check_config(self.config.update(**overrides))

    def check_config(self, config: FusionConfig) -> FusionConfig:
        """Validate `config` for these models, loading its fusion gate if it names one; return it."""
        config.validate(len(self.backends))
        self._gate_session(config)
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
        if not prompts:
            raise ValueError("no prompt given")
        gate = gate or self._gate_session(config)
        with self._lock:
            started = time.perf_counter()
            for backend in self.backends:
                backend.reset_counters()
            encoded = self._encode(prompts, config)
            rows = [_RowState(trace=[] if trace else None) for _ in prompts]
            waiting, active = deque(range(len(prompts))), []  # active: row index of each batch position
            batches: list[TreeBatch] = []
            generator = torch.Generator(device=self.backends[0].model.device).manual_seed(config.seed)
            weights = torch.tensor(config.model_weights or [1.0] * len(self.backends))
            weights = weights / weights.sum()
            capacity = max_batch_size or len(prompts)
            while active or waiting:
                free = capacity - len(active)
                if waiting and free > 0 and (free >= _JOIN_AT * capacity or not active):
                    joining = [waiting.popleft() for _ in range(min(len(waiting), free))]
                    self._join(batches, [[ids[r] for r in joining] for ids in encoded], keep_hidden=gate is not None)
                    active += joining
                if config.unit == "token":
                    proposals, pools = [], [self._token_pool(batches, position, config) for position in range(len(active))]
                    scores = [self._token_scores(batches, position, pool, weights) for position, pool in enumerate(pools)]
                else:
                    budgets = [config.max_new_tokens - rows[r].new_tokens for r in active]
                    proposals = [
                        propose(b, batch, config, budgets, generator, gate, m)
                        for m, (b, batch) in enumerate(zip(self.backends, batches))
                    ]
                    pools = [self._pool(position, proposals) for position in range(len(active))]
                    scores = self._score(batches, pools, weights)
                spans: list[list[list[int]] | list[None]] = [[] for _ in self.backends]
                for position, r in enumerate(active):
                    state, pool = rows[r], pools[position]
                    best = min(range(len(pool)), key=lambda c: scores[position][1][c])
                    chosen = pool[best]
                    self._record_round(state, position, proposals, pool, scores[position], chosen)
                    piece = self._append(state, chosen, config)
                    if piece:
                        yield r, piece
                    for m, backend in enumerate(self.backends):
                        spans[m].append(None if state.finish_reason else backend.encode_piece(chosen.text))
                        if state.finish_reason:
                            state.stats.row_forward_passes[backend.name] = batches[m].rows[position].forwards
                for m, batch in enumerate(batches):
                    batch.commit(spans[m])
                active = [r for r in active if rows[r].finish_reason is None]
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

    def _gate_session(self, config: FusionConfig) -> GateSession | None:
        """The learned gate named by `config.fusion_gate` (loaded once), checked against these models."""
        if config.fusion_gate is None or config.unit == "token":
            return None
        gate = self._gates.get(config.fusion_gate)
        if gate is None:
            gate = load_gate(config.fusion_gate)
            sizes = [b.model.config.get_text_config().hidden_size for b in self.backends]
            if gate.hidden_sizes != sizes:
                raise ValueError(
                    f"fusion gate {config.fusion_gate!r} was trained for models {gate.model_names or gate.hidden_sizes} "
                    f"(hidden sizes {gate.hidden_sizes}), not these ({self.model_names}, hidden sizes {sizes})"
                )
            self._gates[config.fusion_gate] = gate
        return GateSession(gate)

    def _join(self, batches: list[TreeBatch], encoded: list[list[list[int]]], keep_hidden: bool = False) -> None:
        """Prefill new prompts (token ids per model) and add them as rows to the running batches."""
        joining = [backend.start(ids, keep_hidden) for backend, ids in zip(self.backends, encoded)]
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
        per_model = []
        for backend in self.backends:
            encoded = []
            for prompt in prompts:
                if isinstance(prompt, str) and not prompt.strip():
                    raise ValueError("prompt is empty")
                if not isinstance(prompt, str) and not _is_messages(prompt):
                    raise TypeError(f"a prompt must be a string or a list of chat messages, not {type(prompt).__name__}")
                ids = backend.encode_prompt(backend.render(prompt))
                if len(ids) + config.max_new_tokens > backend.context_window:
                    raise ValueError(
                        f"prompt of {len(ids)} tokens plus max_new_tokens={config.max_new_tokens} exceeds the "
                        f"context window of model {backend.name!r} ({backend.context_window} tokens)"
                    )
                encoded.append(ids)
            per_model.append(encoded)
        return per_model

    def _pool(self, position: int, proposals: list[list[RowProposals]]) -> list[_Candidate]:
        """All models' candidate spans for one row, deduplicated by text (and whether they end)."""
        pool: dict[tuple[str, bool], _Candidate] = {}
        for backend, per_row in zip(self.backends, proposals):
            for proposal in per_row[position].proposals:
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
            batches = self._start([prompt], self.config)
            per_model = []
            for backend, batch in zip(self.backends, batches):
                paths = [backend.encode_piece(text) for text in continuations]
                batch.ensure_paths([paths])
                per_model.append([_mean_nll(backend, batch, 0, path, False) for path in paths])
        return [list(row) for row in zip(*per_model)]

    def _score(self, batches: list[TreeBatch], pools: list[list[_Candidate]], weights: torch.Tensor) -> list[tuple[list[list[float]], list[float]]]:
        """Per row: each model's mean token NLL of every candidate, and the weighted fused score.

        One forward per model covers every candidate of every row that is not already in the model's tree.
        A lone candidate needs no scoring, only its tokens in each cache for the commit.
        """
        per_model: list[list[list[float]]] = []
        for backend, batch in zip(self.backends, batches):
            paths = [[backend.encode_piece(c.text) for c in pool] for pool in pools]
            batch.ensure_paths(paths)
            per_model.append([
                [_mean_nll(backend, batch, r, tokens, c.ends) if len(pool) > 1 else 0.0 for tokens, c in zip(row_paths, pool)]
                for r, (row_paths, pool) in enumerate(zip(paths, pools))
            ])
        results = []
        for r, pool in enumerate(pools):
            nll = [[per_model[m][r][c] for m in range(len(self.backends))] for c in range(len(pool))]
            fused = [float(torch.tensor(n) @ weights) for n in nll]
            results.append((nll, fused))
        return results

    def _record_round(self, state: _RowState, position: int, proposals, pool, scores, chosen: _Candidate) -> None:
        state.stats.rounds += 1
        for per_row in proposals:
            state.gate_decisions.extend(per_row[position].decisions)
        state.stats.words_per_round.append(len(chosen.text.split()))
        state.stats.explorations += sum(per_row[position].explored for per_row in proposals)
        if state.trace is not None:
            names = [b.name for b in self.backends]
            state.trace.append(RoundTrace(
                index=state.stats.rounds,
                margins={n: per_row[position].margin for n, per_row in zip(names, proposals)},
                explored={n: per_row[position].explored for n, per_row in zip(names, proposals)},
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
        hits = [i for i in (state.text.find(s, search_from) for s in config.stop) if i >= 0]
        if hits:
            state.text, state.finish_reason = state.text[: min(hits)], "stop"
        elif chosen.ends:
            state.finish_reason = "eos"
        elif state.new_tokens >= config.max_new_tokens or (config.max_rounds and state.stats.rounds >= config.max_rounds):
            state.finish_reason = "length"
            state.text = self._truncate(state.text, config.max_new_tokens)
        safe = len(state.text) if state.finish_reason else len(state.text) - _held_back(state.text, config.stop)
        piece, state.emitted = state.text[state.emitted:safe], max(state.emitted, safe)
        return piece

    def _truncate(self, text: str, max_tokens: int) -> str:
        """Cut text to at most max_tokens tokens of the first model, as transformers' generate would."""
        ids = self.backends[0].encode_piece(text)
        return text if len(ids) <= max_tokens else self.backends[0].decode(ids[:max_tokens])


def _mean_nll(backend: ModelBackend, batch: TreeBatch, row: int, tokens: list[int], ends: bool) -> float:
    """Length-normalised NLL of a span (plus the end token when it ends) under this model, given the prefix."""
    nodes = batch.path_nodes(row, tokens)
    parents = [-1] + nodes[:-1]
    total = sum(float(batch.logprobs(row, p)[t]) for p, t in zip(parents, tokens))
    count = len(tokens)
    if ends:
        total += float(backend.end_logprob(batch.logprobs(row, nodes[-1] if nodes else -1)))
        count += 1
    return -total / count


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop sequence."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)
