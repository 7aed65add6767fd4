"""The fused model as a LangChain `BaseLLM`, usable anywhere an LLM is (LCEL, chains, agents)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import get_config_list

from adafuse.result import GenerationResult
from adafuse.streaming import iterate_in_thread

from .._common import DECODING_FIELDS, engine_options, generation_info
from ._fields import AdaFuseFields

__all__ = ["AdaFuseLLM"]


class AdaFuseLLM(AdaFuseFields, BaseLLM):
    """Several local models fused word by word (AdaFuse) behind LangChain's LLM interface.

    Every `FusionConfig` field (tau_delta, max_span_words, num_branches, ...) is a field here too.

    Example:
        .. code-block:: python

            from adafuse_integrations.langchain import AdaFuseLLM

            llm = AdaFuseLLM(max_new_tokens=64)  # models=[...] for others than the embedded defaults
            llm.invoke("Question: who wrote Hamlet?\\nAnswer:", stop=["\\n"])
    """

    @property
    def _llm_type(self) -> str:
        return "adafuse"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._ls_params("llm", stop, kwargs)

    def generate(self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks = None, **kwargs: Any) -> LLMResult:
        """As `BaseLLM.generate`, with this call's decoding overrides in the model's parameters, so that an LLM cache
        keys on them (LangChain's key holds only the model's fields and `stop`)."""
        target, kwargs = self._with_overrides(kwargs)
        return BaseLLM.generate(target, prompts, stop, callbacks, **kwargs)

    async def agenerate(self, prompts: list[str], stop: list[str] | None = None, callbacks: Callbacks = None,
                        **kwargs: Any) -> LLMResult:
        target, kwargs = self._with_overrides(kwargs)
        return await BaseLLM.agenerate(target, prompts, stop, callbacks, **kwargs)

    def _with_overrides(self, kwargs: dict[str, Any]) -> tuple["AdaFuseLLM", dict[str, Any]]:
        overrides = {k: kwargs[k] for k in kwargs if k in DECODING_FIELDS}
        rest = {k: v for k, v in kwargs.items() if k not in overrides}
        return (self.model_copy(update=overrides) if overrides else self), rest

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
        """Decode the prompts as one batch (`max_batch_size`: at most that many at a time, continuously batched); a
        single prompt joins the engine's running batch, so concurrent calls decode together."""
        kwargs = dict(kwargs)
        max_batch_size = kwargs.pop("max_batch_size", None)
        options = engine_options(self, stop, kwargs)
        if len(prompts) == 1 and max_batch_size is None:
            return [self.engine.batcher.generate(prompts[0], **options)]
        return self.engine.generate(list(prompts), max_batch_size=max_batch_size, **options)

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
        for piece in self.engine.batcher.stream(prompt, **engine_options(self, stop, kwargs)):
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
