"""The fields and behaviour both LangChain classes share: which models, the engine built from them, and what
LangChain asks of any model about itself (identity, token counts, LangSmith parameters)."""
from __future__ import annotations

from typing import Any, Literal

from langchain_core.language_models.base import LangSmithParams
from pydantic import ConfigDict, Field, model_validator

from adafuse import AdaFuse
from adafuse.models import DEFAULT_ENSEMBLE

from .._common import DecodingParameters, build_engine, decoding_config


class AdaFuseFields(DecodingParameters):
    models: list[str] = Field(default_factory=lambda: list(DEFAULT_ENSEMBLE))
    """Embedded model names, Hugging Face ids, local folders or served models (`vllm:http://host:8000/v1#name`);
    ignored when `engine` is given."""
    engine: AdaFuse | None = Field(default=None, exclude=True)
    """An already-built engine to reuse (shares loaded weights between wrappers)."""
    device_map: Any = None
    dtype: Any = None
    stop: list[str] | None = None
    """Default stop sequences; a `stop` given to a call replaces them."""

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    @model_validator(mode="after")
    def _load(self) -> "AdaFuseFields":
        config = decoding_config(self)
        if self.engine is None:
            self.engine = build_engine(self.models, config, self.device_map, self.dtype)
        else:
            self.engine.check_config(config)
            self.models = self.engine.model_names
        return self

    @property
    def model_name(self) -> str:
        return "adafuse(" + "+".join(self.models) + ")"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"models": self.models, **decoding_config(self).to_dict(), "stop": self.stop}

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` under the first model's tokenizer (the one budgets are counted in)."""
        return self.engine.backends[0].tokenizer(text, add_special_tokens=False)["input_ids"]

    def _ls_params(self, kind: Literal["chat", "llm"], stop: list[str] | None, kwargs: dict[str, Any]) -> LangSmithParams:
        """LangSmith's standard parameters; a temperature only where decoding samples with it."""
        params = LangSmithParams(ls_provider="adafuse", ls_model_name=self.model_name, ls_model_type=kind,
                                 ls_max_tokens=kwargs.get("max_new_tokens", self.max_new_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        if kwargs.get("exploration", self.exploration) == "sample":
            params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        return params
