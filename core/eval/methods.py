"""Evaluation method names: what `single:m`, `adafuse:tau=0.5`, `rerank@a+b` and the groups mean."""
from __future__ import annotations

from typing import Any

__all__ = ["ABLATIONS", "BASELINES", "TAU_SWEEP", "engine_overrides", "ensemble_of", "expand_methods"]

ABLATIONS = ["adafuse:B=1", "fixed:1", "fixed:2", "fixed:3"]
BASELINES = ["unite", "rerank"]
TAU_SWEEP = ["adafuse:tau=0.3", "adafuse:tau=0.5", "adafuse:tau=0.9"]


def expand_methods(spec: str, model_names: list[str]) -> list[str]:
    """Method names from a comma list; `single`, `ablations`, `baselines`, `sweep` and `all` expand.

    A fused method runs on every loaded model, or, with a suffix `@a+b`, on the named ones only (`rerank@a+b`,
    `adafuse:scoring=mean@a+b`), so one run compares several ensembles against the same single-model rows."""
    groups = {
        "single": [f"single:{name}" for name in model_names],
        "ablations": ABLATIONS,
        "baselines": BASELINES,
        "sweep": TAU_SWEEP,
    }
    groups["all"] = [*groups["single"], "adafuse", *ABLATIONS, *BASELINES, *TAU_SWEEP]
    methods: list[str] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        for method in groups.get(item, [item]):
            engine_overrides(method, model_names)  # validates the name
            if method not in methods:
                methods.append(method)
    return methods


def ensemble_of(method: str, model_names: list[str]) -> list[str]:
    """The models a method runs on: its `@a+b` suffix, its single model, or all of them."""
    method, _, members = method.partition("@")
    if method.startswith("single:"):
        return [method.split(":", 1)[1]]
    chosen = members.split("+") if members else list(model_names)
    unknown = [name for name in chosen if name not in model_names]
    if unknown or len(set(chosen)) != len(chosen) or len(chosen) < 2:
        raise ValueError(f"method {method!r}: ensemble {chosen} must name two or more of the loaded models {model_names}")
    return chosen


_ADAFUSE_OPTIONS = {"tau": ("tau_delta", float), "B": ("num_branches", int), "gate": ("fusion_gate", str),
                    "scoring": ("scoring", str), "sharpness": ("competence_sharpness", float),
                    "confidence": ("confidence_sharpness", float),
                    "norm": ("span_normalization", str), "veto": ("veto_margin", float), "rerank": ("rerank", str)}

_RERANK_OPTIONS = {name: _ADAFUSE_OPTIONS[name] for name in ("scoring", "sharpness")}


def _options(argument: str, known: dict[str, tuple[str, type]]) -> dict[str, Any] | None:
    """Engine fields from `name=value;name=value`; None when an option is unknown or its value malformed."""
    overrides: dict[str, Any] = {}
    for option in argument.split(";") if argument else []:
        name, _, value = option.partition("=")
        if name not in known or not value:
            return None
        field_name, kind_of = known[name]
        try:
            overrides[field_name] = kind_of(value)
        except ValueError:
            return None
    return overrides


def engine_overrides(method: str, model_names: list[str]) -> dict[str, Any]:
    """Engine overrides that implement a method (single models are handled by the evaluator)."""
    method, _, members = method.partition("@")
    if members:
        ensemble_of(f"{method}@{members}", model_names)
    kind, _, argument = method.partition(":")
    if kind == "single" and argument in model_names:
        return {}
    if kind == "rerank":
        overrides = _options(argument, _RERANK_OPTIONS)
        if overrides is not None:
            return {"rerank": "members", **overrides}
    if kind == "unite" and not argument:
        return {"unit": "token"}
    if kind == "fixed" and argument.isdigit() and int(argument) >= 1:
        return {"fixed_span_words": int(argument)}
    if kind == "adafuse":
        overrides = _options(argument, _ADAFUSE_OPTIONS)
        if overrides is not None:
            return overrides
    raise ValueError(
        f"unknown method {method!r}: use single:<model> ({', '.join(model_names)}), adafuse, adafuse:tau=X, "
        f"adafuse:B=N, adafuse:gate=<folder or shipped name>, adafuse:scoring=mean|competence, adafuse:sharpness=X, adafuse:confidence=X, adafuse:norm=token|char|total, adafuse:veto=X, adafuse:rerank=all, "
        f"several joined by ';' (adafuse:norm=char;scoring=mean), "
        f"fixed:N, unite, rerank, rerank:scoring=mean|competence, rerank:sharpness=X (any fused one with @model+model), or the groups single, ablations, baselines, sweep, all"
    )
