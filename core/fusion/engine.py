"""AdaFuse, the fused model: what callers use (generate, stream, score), over the decoding in `fusion.round`
scheduled by `runtime.scheduler`, or adaptive sampling where the configuration asks for it."""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import closing
from typing import Any, TypeVar

import torch

from ..backend import Backend
from ..loading import load_backend
from ..config import DecodingMode, FusionConfig
from ..models import DEFAULT_ENSEMBLE
from ..prompts import Prompt, normalize_prompt, normalize_prompts
from ..result import GenerationResult
from ..runtime import TokenTree
from ..runtime.scheduler import RowTask, Scheduler
from ..sampling.adaptive import sample_adaptively, sampling_policies
from ..sampling.policies import PolicyCache
from ..streaming import in_worker_thread
from .batcher import RequestBatcher
from .constrained import row_constraint
from .gate import GateSession, gate_session
from .round import RoundContext, rounds
from .scoring import competence_marks, row_weights, span_nll
from .state import CompetenceMarks, RowState

__all__ = ["AdaFuse"]

T = TypeVar("T")
Indexed = list[T] | dict[int, T]  # rows by index: a call's list, or a request batcher's running dict


class AdaFuse:
    """Adaptive word-level ensemble of causal LMs (AdaFuse, arXiv 2601.06022).

    Every round each model proposes whole-word spans (committing up to M words greedily when confident,
    branching on its top-B first tokens when not); every model scores every pooled candidate by mean NLL
    under its own tokenizer; the candidate with the lowest weighted mean NLL extends the shared text.
    """

    def __init__(self, backends: Sequence[Backend], config: FusionConfig | None = None):
        if not backends:
            raise ValueError("AdaFuse needs at least one model")
        self.backends = list(backends)
        self._lock = threading.Lock()
        self._policies = PolicyCache()
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
        """Load models by embedded name, Hugging Face id or local folder (defaults: the embedded pair), or connect to
        served ones (`vllm:http://host:8000/v1#served-name`)."""
        if isinstance(models, str):
            models = [models]
        backends: list[Backend] = []
        try:
            for spec in models:
                backends.append(load_backend(spec, device_map=device_map, dtype=dtype, reuse_prompt_prefix=reuse_prompt_prefix))
            return cls(backends, (config or FusionConfig()).update(**config_overrides))
        except BaseException:
            for backend in backends:
                backend.close()
            raise

    def close(self) -> None:
        """Close the connections of served models (in-process models need nothing)."""
        for backend in self.backends:
            backend.close()

    def __enter__(self) -> "AdaFuse":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @functools.cached_property
    def batcher(self) -> RequestBatcher:
        """This engine's request batcher: calls through it from many threads decode in one continuous batch."""
        return RequestBatcher(self)

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
        used = "token_top_k" if config.decoding_mode() is DecodingMode.TOKEN_FUSION else "num_branches"
        for backend in self.backends:
            if backend.max_top_k is not None and getattr(config, used) > backend.max_top_k:
                raise ValueError(f"invalid {used}={getattr(config, used)}: model {backend.name!r} reports only its "
                                 f"top {backend.max_top_k} next tokens (raise the server's max logprobs)")
        gate_session(self._policies, config, self.backends)
        sampling_policies(self._policies, config, self.backends)
        return config

    # ------------------------------------------------------------------ decoding
    def _decode(self, prompts: list[Prompt], config: FusionConfig, trace: bool, max_batch_size: int | None = None,
                gate: GateSession | None = None) -> Iterator[tuple[int, str | GenerationResult]]:
        """(prompt index, text piece) as rounds commit text, then (prompt index, result) for each prompt."""
        if config.decoding_mode() is DecodingMode.ADAPTIVE_SAMPLING:
            yield from self._sample(prompts, config, max_batch_size)
            return
        with self._lock:
            if config.rerank == "off":
                yield from self._fuse(prompts, config, trace, max_batch_size, gate)
            else:
                yield from self._rerank(prompts, config, trace, max_batch_size)

    def _fuse(self, prompts: list[Prompt], config: FusionConfig, trace: bool, max_batch_size: int | None,
              gate: GateSession | None) -> Iterator[tuple[int, str | GenerationResult]]:
        """Fused decoding of the prompts as one continuous batch (the caller holds the lock)."""
        gate = gate or gate_session(self._policies, config, self.backends)
        started = time.perf_counter()
        for backend in self.backends:
            backend.reset_counters()
        encoded = self._encode(prompts, config)
        rows = [RowState(trace=[] if trace else None, constraint=row_constraint(p, config)) for p in prompts]
        for r, state in enumerate(rows):
            state.stats.prompt_tokens = {b.name: len(ids[r]) for b, ids in zip(self.backends, encoded)}
        scheduler = Scheduler(len(prompts), max_batch_size)
        generator = torch.Generator(device=self.backends[0].device).manual_seed(config.seed)

        def admit(joining: list[int]) -> list[TokenTree]:
            return self._admit(joining, prompts, encoded, rows, [config] * len(prompts), keep_hidden=gate is not None)

        def start(r: int) -> RowTask:
            return self._start_row(r, rows[r], RoundContext(self.backends, scheduler, config, gate, generator))

        for r in scheduler.run(admit, start):
            yield from ((r, piece) for piece in rows[r].take_pieces())
        yield from self._finish(rows, scheduler, time.perf_counter() - started, gate)

    def _rerank(self, prompts: list[Prompt], config: FusionConfig, trace: bool, max_batch_size: int | None
                ) -> Iterator[tuple[int, str | GenerationResult]]:
        """Whole-answer selection: every model answers alone (and, with rerank="all", the fused answer joins them);
        per prompt the answer with the lowest fused score (`rank`) is the result. Nothing streams before the choice."""
        started = time.perf_counter()
        self._encode(prompts, config)  # a bad prompt fails before any decoding
        pools: list[list[GenerationResult]] = [[] for _ in prompts]
        if config.rerank == "all":
            for r, result in _results(self._fuse(prompts, config, trace, max_batch_size, None)):
                pools[r].append(result)
        for member in self._members:
            for r, result in _results(member._fuse(prompts, config.alone(), trace, max_batch_size, None)):
                pools[r].append(result)
        picks = [self._pick(prompt, pool, config) for prompt, pool in zip(prompts, pools)]
        elapsed = time.perf_counter() - started
        scorings = [work for _, _, work in picks]
        for r, ((chosen, weights, work), pool) in enumerate(zip(picks, pools)):
            stats = dataclasses.replace(
                chosen.stats, wall_time_s=elapsed, model_weights=dict(zip(self.model_names, weights)) if weights else {},
                forward_passes=_sum_counts([*_counts(scorings, "forward_passes"), *(x.stats.forward_passes for x in pool)]),
                tokens_processed=_sum_counts([*_counts(scorings, "tokens"), *(x.stats.tokens_processed for x in pool)]),
                row_forward_passes=_sum_counts([*_counts([work], "forward_passes"),
                                                *(x.stats.row_forward_passes for x in pool)]))
            yield r, chosen.text
            yield r, GenerationResult(chosen.text, chosen.finish_reason, stats, chosen.trace)

    def _pick(self, prompt: Prompt, pool: list[GenerationResult], config: FusionConfig
              ) -> tuple[GenerationResult, list[float] | None, dict[str, dict[str, int]]]:
        """The pooled answer with the lowest fused score, the models' weights and each model's work counters for the
        scoring (a blank answer is never chosen over one with text; with one distinct answer nothing is scored)."""
        answers = list(dict.fromkeys(result.text for result in pool if result.text.strip()))
        if len(answers) < 2:
            return next((result for result in pool if result.text in answers), pool[0]), None, {}
        per_model, weights = self._score(prompt, answers, config)
        work = {b.name: b.reset_counters() for b in self.backends}
        fused = _fused_scores(per_model, weights)
        best = answers[min(range(len(answers)), key=fused.__getitem__)]
        return next(result for result in pool if result.text == best), weights.tolist(), work

    @functools.cached_property
    def _members(self) -> list["AdaFuse"]:
        """One engine per model, sharing its backend, for the members' own answers under `rerank`."""
        return [AdaFuse([backend]) for backend in self.backends]

    def _admit(self, joining: list[int], prompts: Indexed[Prompt], encoded: list[Indexed[list[int]]],
               rows: Indexed[RowState], configs: Indexed[FusionConfig], keep_hidden: bool) -> list[TokenTree]:
        """Prefill the joining rows for every model (scoring the prompt tokens that competence reads, for rows whose
        configuration weighs models by competence); rows are looked up by index in lists or dicts."""
        competent = [r for r in joining if self._weighs_by_competence(configs[r])]
        for r in competent:
            rows[r].competence = competence_marks(self.backends, prompts[r])
        scored: list[list[list[bool]] | None] = [None] * len(self.backends)
        if competent:
            scored = [[rows[r].competence[m][0] if rows[r].competence else [False] * len(encoded[m][r]) for r in joining]
                      for m in range(len(self.backends))]
        return [backend.start([ids[r] for r in joining], keep_hidden, marks)
                for backend, ids, marks in zip(self.backends, encoded, scored)]

    def _start_row(self, r: int, state: RowState, context: RoundContext) -> RowTask:
        """A joined row's rounds, with its models' weights for this prompt."""
        state.weights = self._prompt_weights(context.config, context.scheduler.batches, context.scheduler.position(r),
                                             state.competence)
        state.stats.model_weights = dict(zip(self.model_names, state.weights.tolist()))
        return rounds(r, state, context)

    def _weighs_by_competence(self, config: FusionConfig) -> bool:
        return config.scoring == "competence" and len(self.backends) > 1

    def _prompt_weights(self, config: FusionConfig, batches: Sequence[TokenTree], position: int,
                        marks: CompetenceMarks | None) -> torch.Tensor:
        """The models' weights on one prefilled prompt: the normalised prior, scaled by competence where scored."""
        prior = torch.tensor(config.model_weights or [1.0] * len(self.backends))
        return row_weights(prior / prior.sum(), batches, position, marks, config.competence_sharpness)

    def _finish(self, rows: list[RowState], scheduler: Scheduler, elapsed: float, gate: GateSession | None
                ) -> Iterator[tuple[int, str | GenerationResult]]:
        """Every row's remaining text and its result, with the call's work counters."""
        counters = [b.reset_counters() for b in self.backends]
        for r, state in enumerate(rows):
            state.stats.wall_time_s = elapsed
            state.stats.batch_size = len(rows)
            state.stats.new_tokens = state.new_tokens
            state.stats.forward_passes = {b.name: c["forward_passes"] for b, c in zip(self.backends, counters)}
            state.stats.tokens_processed = {b.name: c["tokens"] for b, c in zip(self.backends, counters)}
            state.stats.requests = {b.name: c["requests"] for b, c in zip(self.backends, counters) if "requests" in c}
            state.stats.row_forward_passes = dict(zip(self.model_names, scheduler.row_forwards.get(r, [])))
            if gate is not None and gate.sample:
                gate.decisions[r] = state.gate_decisions
            if state.emitted < len(state.text):
                yield r, state.text[state.emitted:]
            yield r, GenerationResult(state.text, state.finish_reason, state.stats, state.trace)

    def _sample(self, prompts: list[Prompt], config: FusionConfig, max_batch_size: int | None
                ) -> Iterator[tuple[int, str | GenerationResult]]:
        """Adaptive sampling (arXiv 2603.09065) with the model the configured adapters were trained for."""
        backend, token, sequence = sampling_policies(self._policies, config, self.backends)
        with self._lock:
            encoded = self._encode_for(backend, prompts, config)
            texts = [backend.render(p) for p in prompts]
            events = list(sample_adaptively(backend, token, sequence, texts, config, max_batch_size))
        for r, event in events:
            if isinstance(event, GenerationResult):
                event.stats.prompt_tokens = {backend.name: len(encoded[r])}
        yield from events

    def _encode(self, prompts: list[Prompt], config: FusionConfig) -> list[list[list[int]]]:
        """Render and encode each prompt for each model (per model, per prompt), checking it before any work."""
        return [self._encode_for(backend, prompts, config) for backend in self.backends]

    @staticmethod
    def _encode_for(backend: Backend, prompts: list[Prompt], config: FusionConfig) -> list[list[int]]:
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

    def score(self, prompt: Prompt, continuations: list[str]) -> list[list[float]]:
        """Each model's mean token NLL of each continuation of `prompt` (one row per continuation)."""
        with self._lock:
            return self._score(prompt, continuations, self.config.update(scoring="mean"))[0]

    def rank(self, prompt: Prompt, continuations: list[str], **overrides: Any) -> list[float]:
        """Each continuation's fused score under this engine's scoring rule, lower being better: the models' mean
        token NLLs averaged with the weights fusion would give them on `prompt` (competence by default).

        `rerank` picks, among whole answers, the one with the lowest; with competence weights it lets the trusted
        model judge a weaker one's answer instead of being outvoted by its self-confidence.
        """
        config = self._call_config(overrides)
        with self._lock:
            return _fused_scores(*self._score(prompt, continuations, config))

    def _score(self, prompt: Prompt, continuations: list[str], config: FusionConfig
               ) -> tuple[list[list[float]], torch.Tensor]:
        """Per continuation, each model's mean token NLL; and the models' weights for this prompt (the prompt's
        competence tokens are scored in its prefill only when `config` weighs by competence); the caller holds the
        lock."""
        if any(not text for text in continuations):
            raise ValueError("continuations to score must be non-empty strings")
        prompt = normalize_prompt(prompt)
        for backend in self.backends:
            backend.reset_counters()  # left counting this call's work, for callers that report it
        encoded = self._encode([prompt], config)
        marks = competence_marks(self.backends, prompt) if self._weighs_by_competence(config) else None
        per_model, batches = [], []
        for m, (backend, ids) in enumerate(zip(self.backends, encoded)):
            batch = backend.start(ids, scored=[marks[m][0]] if marks else None)
            paths = [backend.encode_piece(text) for text in continuations]
            batch.ensure_paths([paths])
            batches.append(batch)
            per_model.append([span_nll(backend, batch, 0, path, text, False, "token")
                              for path, text in zip(paths, continuations)])
        weights = self._prompt_weights(config, batches, 0, marks)
        return [list(row) for row in zip(*per_model)], weights


def _results(events: Iterator[tuple[int, str | GenerationResult]]) -> Iterator[tuple[int, GenerationResult]]:
    """The (prompt index, result) events of a decoding, its text pieces dropped."""
    return ((r, event) for r, event in events if isinstance(event, GenerationResult))


def _fused_scores(per_model: list[list[float]], weights: torch.Tensor) -> list[float]:
    """Each continuation's models' NLLs averaged with the models' weights."""
    return [float(torch.tensor(row, dtype=weights.dtype) @ weights) for row in per_model]


def _counts(work: list[dict[str, dict[str, int]]], key: str) -> Iterator[dict[str, int]]:
    """One counter (e.g. "forward_passes") per model from each of several calls' work counters."""
    return ({model: counters[key] for model, counters in calls.items()} for calls in work)


def _sum_counts(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Per model, the sum of several calls' counts."""
    total: dict[str, int] = {}
    for count in counts:
        for model, n in count.items():
            total[model] = total.get(model, 0) + n
    return total
