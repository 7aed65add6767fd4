"""A model served by vLLM (or SGLang) behind its OpenAI-compatible completions API, as an ensemble member: the
tokenizer lives here and token ids go over the wire, so the engine's word alignment and scoring are the same as for
a model in this process."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..backend import Backend, context_window_of
from ..models import load_tokenizer
from .batch import Distribution, RemoteBatch, RemoteRow
from .client import BackendError, CompletionsClient

logger = logging.getLogger(__name__)

__all__ = ["RemoteBackend"]

# Text whose tokens a server must agree on with the local tokenizer: words, digits, accents, CJK, emoji, code.
_PROBE = "Hello, world! 1234 Grüße, naïve café. 你好，世界 🙂\n\tdef f(x): return x ** 2  # done"


class RemoteBackend(Backend):
    """A served model: `RemoteBackend("http://host:8000/v1", "gemma3-270m")`.

    `model` is the name the server serves it under (`--served-model-name`); `tokenizer` the local source of the
    same tokenizer (an embedded name, a Hugging Face id or a folder; default: `model`). At start the server must list
    the model and tokenize a probe text exactly as the local tokenizer does, else `BackendError` says why. The
    server reports at most `top_k` next tokens per position (vLLM's `--max-logprobs`, 20 by default), which
    bounds `num_branches` and `token_top_k`.
    """

    def __init__(self, url: str, model: str, *, tokenizer: str | None = None, name: str | None = None, top_k: int = 20,
                 timeout: float = 60.0, retries: int = 2, api_key: str | None = None, check_tokenizer: bool = True,
                 client: CompletionsClient | None = None):
        if top_k < 2:
            raise ValueError(f"invalid top_k={top_k}: the confidence margin needs the top 2 next tokens")
        self.client = client or CompletionsClient(url, timeout=timeout, retries=retries, api_key=api_key)
        self.served_name = model
        try:
            served = self._served_model()
            local, config, generation = load_tokenizer(tokenizer or model)
            text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
            window = min(context_window_of(config), served.get("max_model_len") or math.inf)
            super().__init__(local, name or f"{model}@{self.client.base_url}", config.model_type, text_config.vocab_size,
                             int(window), generation, torch.device("cpu"))
            self.counters["requests"] = 0
            self.max_top_k = top_k
            if check_tokenizer:
                self._check_tokenizer()
        except BaseException:
            self.client.close()
            raise

    def _served_model(self) -> dict[str, Any]:
        listing = self.client.get("models")
        served = {entry.get("id"): entry for entry in listing.get("data", []) if isinstance(entry, dict)}
        if self.served_name not in served:
            raise BackendError(f"model server {self.client.base_url} does not serve {self.served_name!r} "
                               f"(it serves {sorted(served)})")
        return served[self.served_name]

    def _check_tokenizer(self) -> None:
        """Refuse a server whose tokenizer splits the probe text differently from the local one."""
        try:
            answer = self.client.post("//tokenize", {"model": self.served_name, "prompt": _PROBE, "add_special_tokens": False})
        except BackendError as error:
            if "HTTP 404" not in str(error):
                raise
            logger.warning("model server %s has no /tokenize route: its tokenizer is not checked", self.client.base_url)
            return
        theirs, ours = answer.get("tokens"), self.tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        if theirs != ours:
            raise BackendError(
                f"model server {self.client.base_url} tokenizes differently from the local tokenizer of "
                f"{self.served_name!r} (probe text: {len(theirs or [])} vs {len(ours)} tokens); give the tokenizer the "
                "server was started with (tokenizer=...)")

    # ------------------------------------------------------------------ requests
    def start(self, prompts: list[list[int]], keep_hidden: bool = False, scored: list[list[bool]] | None = None) -> RemoteBatch:
        if keep_hidden:
            raise ValueError(f"model {self.name!r} is served remotely and cannot return hidden states")
        self._piece_cache.clear()
        answers = self._complete([self._body(ids, prompt_logprobs=scored is not None) for ids in prompts])
        rows = []
        for r, (ids, answer) in enumerate(zip(prompts, answers)):
            row = RemoteRow(ids=list(ids), forwards=1, root=self._distribution(answer))
            if scored is not None:
                row.prompt_nll = _prompt_nll(answer, ids, scored[r])
            rows.append(row)
        self.counters["forward_passes"] += 1
        self.counters["tokens"] += sum(len(ids) for ids in prompts)
        return RemoteBatch(self, rows)

    def next_tokens(self, prefixes: list[list[int]]) -> list[Distribution]:
        """The next-token distribution after each prefix, asked concurrently."""
        return [self._distribution(answer) for answer in self._complete([self._body(p) for p in prefixes])]

    def token_logprobs(self, queries: list[tuple[list[int], int]]) -> list[float]:
        """The exact log-probability of each token after its prefix (outside the reported top k): the token is the
        only one allowed, and vLLM reports the raw log-probability of what it picked."""
        answers = self._complete([self._body(prefix, allowed=token) for prefix, token in queries])
        return [_choice_logprobs(answer)["token_logprobs"][0] for answer in answers]

    def _body(self, prompt: list[int], *, prompt_logprobs: bool = False, allowed: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.served_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                                "logprobs": self.max_top_k, "return_tokens_as_token_ids": True}
        if prompt_logprobs:
            body["prompt_logprobs"] = 0
        if allowed is not None:
            body["allowed_token_ids"] = [allowed]
        return body

    def _complete(self, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.counters["requests"] += len(bodies)
        return self.client.post_many("completions", bodies)

    def _distribution(self, answer: dict[str, Any]) -> Distribution:
        top = _choice_logprobs(answer)["top_logprobs"][0]
        try:
            return Distribution.from_top({_token_id(key): float(value) for key, value in top.items()}, self.vocab_size)
        except (ValueError, IndexError) as error:
            raise BackendError(f"model server {self.client.base_url} sent next-token log-probabilities this tokenizer "
                               f"cannot place ({error}): is it serving {self.served_name!r} with the same vocabulary?") from error

    def close(self) -> None:
        self.client.close()


def _choice_logprobs(answer: dict[str, Any]) -> dict[str, Any]:
    try:
        logprobs = answer["choices"][0]["logprobs"]
        if not logprobs["top_logprobs"]:
            raise KeyError("top_logprobs")
        return logprobs
    except (KeyError, IndexError, TypeError) as error:
        raise BackendError(f"a model server answered a completions request without log-probabilities ({error!r}): "
                           f"{str(answer)[:200]}") from error


def _token_id(key: str) -> int:
    """A token in a `return_tokens_as_token_ids` answer: "token_id:123"."""
    if not key.startswith("token_id:"):
        raise ValueError(f"token {key!r} is not given by id (the server ignored return_tokens_as_token_ids)")
    return int(key[len("token_id:"):])


def _prompt_nll(answer: dict[str, Any], ids: list[int], scored: list[bool]) -> list[float]:
    """Each prompt token's NLL from the answer's `prompt_logprobs` where `scored` marks it, NaN elsewhere."""
    entries = answer["choices"][0].get("prompt_logprobs") or answer.get("prompt_logprobs")
    if not entries or len(entries) != len(ids):
        raise BackendError(f"a model server answered without prompt log-probabilities for {len(ids)} prompt tokens")
    nll = []
    for position, (token, entry) in enumerate(zip(ids, entries)):
        found = entry.get(str(token)) if position < len(scored) and scored[position] and entry else None
        nll.append(-float(found["logprob"]) if found else math.nan)
    return nll
