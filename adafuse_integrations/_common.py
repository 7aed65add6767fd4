"""Glue shared by the framework adapters: building the engine from fields, per-call options, reply metadata."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import BaseModel, create_model

from adafuse import AdaFuse, FusionConfig
from adafuse.result import GenerationResult

# Framework users expect room for a paragraph; the engine's own default suits short completions.
_ADAPTER_DEFAULTS = {"max_new_tokens": 256}

# Pydantic fields mirroring every FusionConfig field (stop excepted: adapters merge it per call), generated
# from the dataclass so the engine's configuration stays the one source of names, types and defaults.
DecodingParameters: type[BaseModel] = create_model(
    "DecodingParameters",
    **{
        f.name: (typing.get_type_hints(FusionConfig)[f.name], _ADAPTER_DEFAULTS.get(f.name, f.default))
        for f in dataclasses.fields(FusionConfig)
        if f.name != "stop"
    },
)
DECODING_FIELDS = tuple(DecodingParameters.model_fields)


def decoding_config(source: Any) -> FusionConfig:
    """A FusionConfig from an adapter's fields of the same names."""
    return FusionConfig(**{name: getattr(source, name) for name in DECODING_FIELDS})


def build_engine(models: list[str], config: FusionConfig, device_map: Any, dtype: Any) -> AdaFuse:
    return AdaFuse.from_pretrained(models, config.validate(len(models)), device_map=device_map, dtype=dtype)


def call_options(stop: list[str] | None, default_stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Per-call engine overrides: decoding fields given as keyword arguments plus the merged stop list."""
    unknown = sorted(set(kwargs) - set(DECODING_FIELDS))
    if unknown:
        raise ValueError(f"unknown decoding parameter(s) {unknown}; known: {sorted(DECODING_FIELDS)}")
    return {**kwargs, "stop": list(stop if stop is not None else default_stop or [])}


def engine_options(adapter: Any, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Everything one engine call takes: the adapter's decoding fields overridden by this call's."""
    return {**decoding_config(adapter).to_dict(), **call_options(stop, adapter.stop, kwargs)}


def generation_info(result: GenerationResult) -> dict[str, Any]:
    stats = result.stats
    return {
        "finish_reason": result.finish_reason,
        "rounds": stats.rounds,
        "explorations": stats.explorations,
        "new_tokens": stats.new_tokens,
        "forward_passes": stats.forward_passes,
        "row_forward_passes": stats.row_forward_passes,
        "tokens_processed": stats.tokens_processed,
        "wall_time_s": stats.wall_time_s,
        "model_weights": stats.model_weights,
    }
