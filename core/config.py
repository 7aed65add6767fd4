"""Decoding configuration, in the spirit of transformers' GenerationConfig."""
from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from .constraints import compile_constraint

ExplorationKind = Literal["topk", "sample"]
FusionUnit = Literal["word", "token"]
Rerank = Literal["off", "members", "all"]
Scoring = Literal["mean", "competence"]
SpanNormalization = Literal["token", "char", "total"]

__all__ = ["DECODING_PARAMETERS", "DecodingMode", "FusionConfig", "SamplingFilter"]

# Fields whose None is a setting (off), so an override of None replaces them instead of being ignored.
_NULLABLE = ("fixed_span_words", "max_rounds", "veto_margin", "model_weights", "fusion_gate", "token_adapter", "sequence_adapter",
             "json_schema", "regex")


@dataclass(frozen=True)
class SamplingFilter:
    """How one next-token distribution is sampled: temperature (0 means greedy), then top-k, top-p and min-p
    filters (0, 1.0 and 0.0 switch them off). AdaFuse's "sample" exploration and the adaptive sampler both use it."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


class DecodingMode(enum.Enum):
    """Which decoding a configuration asks for; the engine dispatches on it once per call."""

    WORD_FUSION = "word"  # AdaFuse: whole-word spans, gated by confidence (or fixed spans)
    TOKEN_FUSION = "token"  # the token-level baseline (UniTE-style)
    ADAPTIVE_SAMPLING = "adaptive"  # one model sampled with learned decoding adapters (arXiv 2603.09065)


@dataclass
class FusionConfig:
    """Every knob of AdaFuse decoding; `validate()` names the first bad parameter.

    Attributes:
        tau_delta: confidence margin p1 - p2 at a word's first token above which a model keeps going.
        max_span_words: M, the most words one model may commit in one round.
        num_branches: B, first tokens explored when a model is not confident (1 disables exploration).
        exploration: "topk" takes the B most likely first tokens, "sample" draws B distinct ones.
        temperature, top_k, top_p, min_p: the sampling filter used by "sample" exploration.
        fixed_span_words: when set, every model commits exactly this many words per round with no gate
            and no exploration (the paper's fixed-span ablation).
        model_weights: weight of each model in the fused NLL (defaults to equal weights).
        scoring: how the models' NLLs of a candidate combine. "mean" is the paper's weighted mean with
            `model_weights`; "competence" multiplies those weights, per prompt, by
            exp(-competence_sharpness * (the model's prompt NLL per character - the best model's)), so the
            model that predicts the prompt best counts most (see `adafuse.fusion.scoring`).
        competence_sharpness: how fast a model's weight falls with its prompt NLL per character (nats/char);
            at 30 a model 0.1 nats/char behind the best counts exp(-3), a twentieth, as much.
        confidence_sharpness: per word round, each model's weight is further scaled by
            exp(-confidence_sharpness * its NLL of the candidate it finds likeliest) (in the unit of
            `span_normalization`): a model that finds none of the round's candidates likely counts less in that
            round. 0, the default, leaves the prompt's weights.
        span_normalization: each model's NLL of a candidate in total ("total", the span's joint probability:
            a longer candidate must earn each extra word), per token ("token", the paper) or per character ("char").
        veto_margin: when set, a candidate whose NLL under the most-weighted model exceeds that model's NLL of its
            favourite candidate by more than this (in the unit of `span_normalization`) cannot win: the model
            trusted most vetoes what it finds much less likely, whatever the others say. None: no veto.
        max_new_tokens: budget counted in tokens of the first model.
        min_new_tokens: no end token is chosen before the answer has this many tokens (of the first model), as in
            transformers' GenerationConfig: a model whose likeliest first token ends the answer offers words instead.
        max_rounds: optional cap on decoding rounds.
        max_word_tokens: the most tokens one word may take before it is cut (guards runaway words).
        stop: strings that end generation; the text is cut before the first one found.
        stop_after_text: look for stop strings only after the first non-whitespace character, so an answer that
            opens with a newline is not cut to nothing under stop "\n" (the evaluation judges every method by
            its first non-empty line this way).
        seed: seeds sampling exploration.
        unit: "word" is AdaFuse; "token" is the token-level baseline (UniTE-style): each round pools every
            model's `token_top_k` next tokens by text and picks the highest mean probability.
        token_top_k: tokens each model contributes per round in "token" mode.
        fusion_gate: folder (or shipped name) of a learned `FusionGate` that makes the commit/explore decision
            in place of tau_delta.
        token_adapter, sequence_adapter: folder (or shipped name) of a learned decoding adapter (arXiv
            2603.09065). Either one switches from fusion to adaptive sampling with the model the adapter was
            trained for (one of the fused models): the sequence adapter picks a sampling configuration per
            prompt, the token adapter a temperature at every step.
        num_samples: parallel samples per prompt under adaptive sampling; the majority answer is returned.
        rerank: choose among whole answers after decoding. "members": each model answers alone (greedy) and the
            answer with the lowest fused score (`AdaFuse.rank`: mean NLLs weighted as `scoring` weighs the models)
            wins, the sample-level baseline; "all": the fused answer competes with the members' answers (suits short
            answers; for translation the word-level answer alone scored higher); "off": the fused answer.
        json_schema, regex: the answer must match this JSON schema (a dict) or regular expression; every round's
            candidates are cut to what can still match, and an answer cut short by the budget is closed, so it
            always parses (`adafuse.constraints`). Word-level fusion only.
    """

    tau_delta: float = 0.7
    max_span_words: int = 3
    num_branches: int = 3
    exploration: ExplorationKind = "topk"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    fixed_span_words: int | None = None
    model_weights: list[float] | None = None
    scoring: Scoring = "competence"
    competence_sharpness: float = 30.0
    confidence_sharpness: float = 0.0
    span_normalization: SpanNormalization = "total"
    veto_margin: float | None = None
    max_new_tokens: int = 64
    min_new_tokens: int = 0
    max_rounds: int | None = None
    max_word_tokens: int = 24
    stop: list[str] = field(default_factory=list)
    stop_after_text: bool = False
    seed: int = 0
    unit: FusionUnit = "word"
    token_top_k: int = 10
    fusion_gate: str | None = None
    token_adapter: str | None = None
    sequence_adapter: str | None = None
    num_samples: int = 1
    rerank: Rerank = "off"
    json_schema: dict | None = None
    regex: str | None = None

    def validate(self, num_models: int | None = None) -> "FusionConfig":
        """Raise TypeError naming the first parameter of the wrong type, ValueError the first out of range;
        return self."""
        self._check_types()
        self._check_ranges()
        self._check_model_weights(num_models)
        self._check_constraint()
        return self

    def _check_constraint(self) -> None:
        if self.json_schema is None and self.regex is None:
            return
        if self.json_schema is not None and self.regex is not None:
            raise ValueError("invalid json_schema and regex: give one constraint, not both")
        if self.decoding_mode() is not DecodingMode.WORD_FUSION:
            raise ValueError(f"invalid {'json_schema' if self.json_schema is not None else 'regex'}: constrained output "
                             "needs word-level fusion (unit='word', no token or sequence adapter)")
        compile_constraint(self.json_schema, self.regex)

    def _check_ranges(self) -> None:
        checks = [
            ("tau_delta", 0.0 <= self.tau_delta <= 1.0, "a margin between 0 and 1"),
            ("max_span_words", self.max_span_words >= 1, "at least 1"),
            ("num_branches", self.num_branches >= 1, "at least 1"),
            ("exploration", self.exploration in ("topk", "sample"), "'topk' or 'sample'"),
            ("temperature", self.temperature > 0, "positive"),
            ("top_k", self.top_k >= 0, "0 (off) or positive"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p < 1.0, "in [0, 1)"),
            ("fixed_span_words", self.fixed_span_words is None or self.fixed_span_words >= 1, "None or at least 1"),
            ("max_new_tokens", self.max_new_tokens >= 1, "at least 1"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens, "between 0 and max_new_tokens"),
            ("max_rounds", self.max_rounds is None or self.max_rounds >= 1, "None or at least 1"),
            ("max_word_tokens", self.max_word_tokens >= 1, "at least 1"),
            ("seed", 0 <= self.seed < 2**64, "in [0, 2**64)"),
            ("unit", self.unit in ("word", "token"), "'word' or 'token'"),
            ("scoring", self.scoring in ("mean", "competence"), "'mean' or 'competence'"),
            ("span_normalization", self.span_normalization in ("token", "char", "total"), "'token', 'char' or 'total'"),
            ("competence_sharpness", self.competence_sharpness >= 0, "at least 0"),
            ("confidence_sharpness", self.confidence_sharpness >= 0, "at least 0"),
            ("veto_margin", self.veto_margin is None or self.veto_margin >= 0, "None or at least 0"),
            ("token_top_k", self.token_top_k >= 1, "at least 1"),
            ("stop", all(self.stop), "a list of non-empty strings"),
            ("num_samples", self.num_samples == 1 or (self.num_samples > 1 and self.samples_adaptively),
             "1, or more with a token_adapter or sequence_adapter (fused decoding is deterministic)"),
            ("fusion_gate", self.fusion_gate is None or not self.samples_adaptively,
             "None when a token_adapter or sequence_adapter samples instead of fusing"),
            ("rerank", self.rerank in ("off", "members", "all"), "'off', 'members' or 'all'"),
            ("rerank", self.rerank == "off" or not self.samples_adaptively,
             "'off' when a token_adapter or sequence_adapter samples instead of fusing"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: expected {expected}")

    def _check_model_weights(self, num_models: int | None) -> None:
        if self.model_weights is None:
            return
        if any(w < 0 for w in self.model_weights) or sum(self.model_weights) <= 0:
            raise ValueError(f"invalid model_weights={self.model_weights!r}: expected non-negative, not all zero")
        if num_models is not None and len(self.model_weights) != num_models:
            raise ValueError(f"invalid model_weights={self.model_weights!r}: expected {num_models} weights, one per model")

    def _check_types(self) -> None:
        """Every field against its annotation; a NaN or infinity, which would turn every score into NaN, is a
        ValueError."""
        hints = typing.get_type_hints(FusionConfig)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _has_type(value, hints[f.name]):
                raise TypeError(f"invalid {f.name}={value!r}: expected {_describe(hints[f.name])}, "
                                f"got {type(value).__name__}")
            if not _finite(value):
                raise ValueError(f"invalid {f.name}={value!r}: expected finite numbers")

    @property
    def samples_adaptively(self) -> bool:
        """Whether a learned decoding adapter replaces fusion with adaptive single-model sampling."""
        return self.token_adapter is not None or self.sequence_adapter is not None

    def decoding_mode(self) -> DecodingMode:
        """The decoding these settings select (as transformers' `GenerationConfig.get_generation_mode`)."""
        if self.samples_adaptively:
            return DecodingMode.ADAPTIVE_SAMPLING
        return DecodingMode.TOKEN_FUSION if self.unit == "token" else DecodingMode.WORD_FUSION

    @property
    def decodes_row_by_row(self) -> bool:
        """Whether each prompt's rounds can share a batch with other prompts' (what the request batcher decodes);
        learned samplers, fusion gates and whole-answer reranking decode their own way."""
        return not self.samples_adaptively and self.fusion_gate is None and self.rerank == "off"

    def alone(self) -> "FusionConfig":
        """The settings one model answers with on its own: plain greedy decoding (every margin passes tau_delta=0, one
        branch) without the ensemble-only parts; the single-model baseline and rerank's members use it."""
        return self.update(tau_delta=0.0, num_branches=1, fixed_span_words=None, model_weights=None, fusion_gate=None,
                           rerank="off")

    @property
    def sampling_filter(self) -> SamplingFilter:
        """The filter "sample" exploration draws first tokens with."""
        return SamplingFilter(self.temperature, self.top_k, self.top_p, self.min_p)

    def update(self, **overrides: Any) -> "FusionConfig":
        """A copy with the given fields replaced; unknown names raise ValueError."""
        unknown = sorted(set(overrides) - DECODING_PARAMETERS)
        if unknown:
            raise ValueError(f"unknown decoding parameter(s) {unknown}; known: {sorted(DECODING_PARAMETERS)}")
        if isinstance(overrides.get("stop"), str):
            overrides["stop"] = [overrides["stop"]]
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None or k in _NULLABLE})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DECODING_PARAMETERS = frozenset(f.name for f in dataclasses.fields(FusionConfig))
"""The names a call may override (`FusionConfig.update`, the server's request fields)."""


_LIST_ITEMS = {float: "numbers", str: "strings"}


def _has_type(value: Any, hint: Any) -> bool:
    """Whether `value` fits a field's annotation (bools are not numbers here; ranges are checked after)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_has_type(value, arg) for arg in args)
    if origin is Literal:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_has_type(item, args[0]) for item in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def _finite(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    return all(math.isfinite(item) for item in items if isinstance(item, float))


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(arg) for arg in args)
    if origin is Literal:
        return "a string"
    if origin is list:
        return f"a list of {_LIST_ITEMS.get(args[0], args[0].__name__)}"
    if hint is type(None):
        return "None"
    return {float: "a number", int: "an integer", bool: "True or False", str: "a string"}.get(hint, hint.__name__)

