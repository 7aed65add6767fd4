"""LlamaIndex backend: the fused model as a `CustomLLM`, usable as `Settings.llm` in query engines."""
from __future__ import annotations

import asyncio
from contextlib import closing
from typing import Any

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseAsyncGen, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from adafuse import AdaFuse
from adafuse.models import DEFAULT_ENSEMBLE
from adafuse.result import GenerationResult

from ._common import DecodingParameters, build_engine, decoding_config, engine_options, generation_info, iterate_in_thread

__all__ = ["AdaFuseLLM"]


class AdaFuseLLM(CustomLLM, DecodingParameters):
    """Several local models fused word by word (AdaFuse) behind LlamaIndex's LLM interface.

    Every `FusionConfig` field (tau_delta, max_span_words, num_branches, ...) is a field here too.

    Example:
        .. code-block:: python

            from llama_index.core import Settings
            from adafuse_integrations.llama_index import AdaFuseLLM

            Settings.llm = AdaFuseLLM(max_new_tokens=64)  # models=[...] for others than the embedded defaults
    """

    models: list[str] = Field(default_factory=lambda: list(DEFAULT_ENSEMBLE), description="model names, ids, folders or served models (vllm:URL#name)")
    device_map: Any = Field(default=None, description="accelerate device map, e.g. 'cuda'")
    dtype: Any = Field(default=None, description="torch dtype, e.g. 'bfloat16'")
    stop: list[str] | None = Field(default=None, description="stop sequences")

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())
    _engine: AdaFuse = PrivateAttr()

    def __init__(self, engine: AdaFuse | None = None, **kwargs: Any) -> None:
        if engine is not None:
            kwargs.setdefault("models", engine.model_names)
        super().__init__(**kwargs)
        config = decoding_config(self)
        self._engine = engine if engine is not None else build_engine(self.models, config, self.device_map, self.dtype)
        self._engine.check_config(config)

    @classmethod
    def class_name(cls) -> str:
        return "AdaFuseLLM"

    @property
    def engine(self) -> AdaFuse:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_window,
            num_output=self.max_new_tokens,
            model_name="adafuse(" + "+".join(self._engine.model_names) + ")",
            is_chat_model=False,
        )

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(kwargs)
        kwargs.pop("formatted", None)
        return engine_options(self, kwargs.pop("stop", None), kwargs)

    def _prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = self._engine.generate(self._prompt(prompt, formatted), **self._options(kwargs))
        return CompletionResponse(text=result.text, additional_kwargs=generation_info(result), raw=None)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self._engine.stream(self._prompt(prompt, formatted), **self._options(kwargs))

        def gen() -> CompletionResponseGen:
            text = ""
            with closing(pieces):
                for piece in pieces:
                    if isinstance(piece, GenerationResult):
                        yield CompletionResponse(text=text, delta="", additional_kwargs=generation_info(piece))
                    else:
                        text += piece
                        yield CompletionResponse(text=text, delta=piece)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self.complete, prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        return iterate_in_thread(lambda: self.stream_complete(prompt, formatted, **kwargs))
