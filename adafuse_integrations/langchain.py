"""LangChain backend: the fused model as a `BaseLLM`, usable anywhere an LLM is (LCEL, chains, agents)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list
from pydantic import ConfigDict, Field, model_validator

from adafuse import AdaFuse
from adafuse.models import DEFAULT_ENSEMBLE
from adafuse.result import GenerationResult

from ._common import DecodingParameters, build_engine, decoding_config, engine_options, generation_info, iterate_in_thread

__all__ = ["AdaFuseLLM"]


class AdaFuseLLM(BaseLLM, DecodingParameters):
    """Several local models fused word by word (AdaFuse) behind LangChain's LLM interface.

    Every `FusionConfig` field (tau_delta, max_span_words, num_branches, ...) is a field here too.

    Example:
        .. code-block:: python

            from adafuse_integrations.langchain import AdaFuseLLM

            llm = AdaFuseLLM(max_new_tokens=64)  # models=[...] for others than the embedded defaults
            llm.invoke("Question: who wrote Hamlet?\\nAnswer:", stop=["\\n"])
    """

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
    def _load(self) -> "AdaFuseLLM":
        config = decoding_config(self)
        if self.engine is None:
            self.engine = build_engine(self.models, config, self.device_map, self.dtype)
        else:
            self.engine.check_config(config)
            self.models = self.engine.model_names
        return self

    @property
    def _llm_type(self) -> str:
        return "adafuse"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"models": self.models, **decoding_config(self).to_dict(), "stop": self.stop}

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[str | Exception]:
        """As `BaseLLM.batch`; with `return_exceptions`, a prompt the engine refuses gets its own error and the
        others still decode together (LangChain's default would hand every prompt of the batch the same error)."""
        if not return_exceptions or not inputs:
            return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        configs = get_config_list(config, len(inputs))
        options = engine_options(self, kwargs.get("stop"), {k: v for k, v in kwargs.items() if k != "stop"})
        outputs: list[str | Exception | None] = [None] * len(inputs)
        accepted = []
        for i, value in enumerate(inputs):
            try:
                self.engine.check_prompt(self._convert_input(value).to_string(), **options)
                accepted.append(i)
            except (ValueError, TypeError) as error:
                outputs[i] = error
        if accepted:
            decoded = super().batch([inputs[i] for i in accepted], [configs[i] for i in accepted],
                                    return_exceptions=True, **kwargs)
            for i, output in zip(accepted, decoded):
                outputs[i] = output
        return outputs

    def _run(self, prompts: list[str], stop: list[str] | None, kwargs: dict[str, Any]) -> list[GenerationResult]:
        return self.engine.generate(list(prompts), **engine_options(self, stop, kwargs))

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        results = self._run(prompts, stop, kwargs)
        return LLMResult(generations=[[Generation(text=r.text, generation_info=generation_info(r))] for r in results])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        results = await asyncio.to_thread(self._run, prompts, stop, kwargs)
        return LLMResult(generations=[[Generation(text=r.text, generation_info=generation_info(r))] for r in results])

    def _chunks(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> Iterator[GenerationChunk]:
        for piece in self.engine.stream(prompt, **engine_options(self, stop, kwargs)):
            if isinstance(piece, GenerationResult):
                yield GenerationChunk(text="", generation_info=generation_info(piece))
            else:
                yield GenerationChunk(text=piece)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._chunks(prompt, stop, kwargs)):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
