"""One model of the ensemble as the engine sees it: a tokenizer (text <-> ids, word starts, end tokens), work
counters, and `start()`, which encodes prompts into a `TokenTree` the engine decodes over. `ModelBackend` runs
the model in this process; `adafuse.remote.RemoteBackend` asks a served one."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from .chat import Chat, Message, render_chat
from .kernels import prepare_for_cpu
from .models import load_model
from .runtime import ModelRunner, OutputHead, PromptPrefixCache, TokenTree, TreeBatch, prefill
from .words import blank_token_table, word_start_table

logger = logging.getLogger(__name__)

__all__ = ["Backend", "ModelBackend", "context_window_of"]

_END_OF_TURN_PIECES = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>")


class Backend(ABC):
    """What the engine needs of one model: its tokenizer's view of text and a way to run token trees.

    `hidden_size` is the width of the final-layer states that learned policies read (None where a backend cannot
    return them); `max_top_k` the most next-token alternatives it reports per position (None: the whole
    vocabulary).
    """

    hidden_size: int | None = None
    max_top_k: int | None = None

    def __init__(self, tokenizer: PreTrainedTokenizerBase, name: str, model_type: str, vocab_size: int,
                 context_window: int, generation_config: GenerationConfig | None, device: torch.device):
        self.tokenizer, self.name, self.model_type = tokenizer, name, model_type
        self.vocab_size, self.context_window, self.device = vocab_size, context_window, device
        self.counters = {"forward_passes": 0, "tokens": 0}
        self.starts_word = word_start_table(tokenizer, vocab_size).to(device)
        self.blank = blank_token_table(tokenizer, vocab_size).to(device)
        self.end_ids = self._end_token_ids(generation_config)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.end_ids)
        self._piece_cache: dict[str, list[int]] = {}

    def _end_token_ids(self, generation_config: GenerationConfig | None) -> list[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
            ids.update(source if isinstance(source, list) else [source] if source is not None else [])
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[piece] for piece in _END_OF_TURN_PIECES if piece in vocab)
        ids = {i for i in ids if i < self.vocab_size}
        if not ids:
            raise ValueError(f"model {self.name!r} has no end-of-sequence token")
        return sorted(ids)

    @abstractmethod
    def start(self, prompts: list[list[int]], keep_hidden: bool = False, scored: list[list[bool]] | None = None) -> TokenTree:
        """Encode prompts (token ids) into a new batch (`scored`: and the NLL of the marked tokens of each prompt,
        into each row's `prompt_nll`, NaN for the others)."""

    # ------------------------------------------------------------------ text <-> tokens
    def render(self, prompt: str | list[Message] | Chat) -> str:
        """Prompt text for this model: the string itself, or chat messages (and tools) through its chat template."""
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, Chat):
            return render_chat(self.tokenizer, self.model_type, prompt.messages, prompt.tools) + prompt.response_prefix
        return render_chat(self.tokenizer, self.model_type, prompt)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt with this tokenizer's usual special tokens (BOS where it adds one)."""
        return self.tokenizer(text, add_special_tokens=self._adds_special_tokens(text))["input_ids"]

    def _adds_special_tokens(self, text: str) -> bool:
        """False for text a chat template already opened with BOS."""
        return not (self.tokenizer.bos_token is not None and text.startswith(self.tokenizer.bos_token))

    def prompt_offsets(self, text: str) -> list[tuple[int, int]] | None:
        """Character span of each token of `encode_prompt(text)`, or None where the tokenizer cannot say (slow
        tokenizers)."""
        try:
            encoded = self.tokenizer(text, add_special_tokens=self._adds_special_tokens(text), return_offsets_mapping=True)
        except NotImplementedError:
            return None
        return [tuple(span) for span in encoded["offset_mapping"]]

    def encode_piece(self, text: str) -> list[int]:
        """Token ids of a span of generated text, without special tokens (memoised within a request)."""
        ids = self._piece_cache.get(text)
        if ids is None:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self._piece_cache[text] = ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def truncate(self, text: str, max_tokens: int) -> str:
        """`text` cut to at most `max_tokens` tokens of this tokenizer, as transformers' generate would. A cut inside
        a character's bytes decodes to U+FFFD, which is not a prefix of the text and may re-encode to more tokens
        than the budget (when the text holds U+FFFD itself): such cuts back off to a whole character."""
        ids = self.encode_piece(text)
        if len(ids) <= max_tokens:
            return text
        keep = max_tokens
        cut = self.decode(ids[:keep])
        while keep > 0 and not (text.startswith(cut) and len(self.encode_piece(cut)) <= max_tokens):
            keep -= 1
            cut = self.decode(ids[:keep])
        return cut

    def end_logprob(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Log-probability of ending the sequence here, over all of this model's end tokens."""
        return torch.logsumexp(logprobs[self.end_ids], dim=-1)

    def without_end(self, logprobs: torch.Tensor) -> torch.Tensor:
        """Next-token log-distributions (`[..., V]`) with the end tokens taken out and the rest renormalised, as
        transformers' `MinNewTokensLogitsProcessor` leaves them before an answer reaches `min_new_tokens`."""
        masked = logprobs.clone()
        masked[..., self.end_ids] = -torch.inf
        if torch.isneginf(masked).all(dim=-1).any():
            raise RuntimeError(f"model {self.name!r} gives only end tokens a probability, so min_new_tokens cannot "
                               "hold the end back (a served model reporting too few top log-probabilities?)")
        return masked.log_softmax(dim=-1)

    def reset_counters(self) -> dict[str, int]:
        """Return the counters so far and zero them."""
        counts = dict(self.counters)
        self.counters.update(dict.fromkeys(self.counters, 0))
        return counts

    def close(self) -> None:
        """Release what the backend holds outside this process (connections); nothing for an in-process model."""


class ModelBackend(Backend):
    """A causal LM prepared for word-level fusion.

    Per-request state lives in the `TreeBatch` that `start()` returns (the KV cache and scratch tree of a
    batch of prompts); the backend keeps only the KV of the last prompt, reused by prompts that begin the same
    way. One backend serves many requests, one at a time.

    With `cpu_kernels=True` a CPU model gets faster kernels (`adafuse.kernels`: oneDNN-packed linear layers,
    copy-free grouped-query attention, a malloc that keeps freed memory), which change the model object and treat
    its weights as frozen; so a model you pass in is left as it is unless you ask. `from_pretrained`, which loads
    a model of its own, asks by default.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str | None = None,
        *,
        reuse_prompt_prefix: bool = True,
        cpu_kernels: bool = False,
    ):
        self.model = model.eval()
        tuning = prepare_for_cpu(self.model) if cpu_kernels else None
        super().__init__(tokenizer, name or getattr(model.config, "_name_or_path", None) or model.config.model_type,
                         model.config.model_type, model.get_output_embeddings().weight.shape[0],
                         context_window_of(model.config), model.generation_config, model.device)
        self.prefix_cache = PromptPrefixCache() if reuse_prompt_prefix else None
        self.runner = ModelRunner(self.model, self.counters, tuning, OutputHead.of(self.model))
        self.hidden_size = _text_config(model.config).hidden_size

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        device_map: str | dict | None = None,
        dtype: str | torch.dtype | None = None,
        reuse_prompt_prefix: bool = True,
        cpu_kernels: bool = True,
        **kwargs: Any,
    ) -> "ModelBackend":
        """Load an embedded default model name, a Hugging Face id or a local folder."""
        model, tokenizer = load_model(name_or_path, device_map=device_map, dtype=dtype, **kwargs)
        return cls(model, tokenizer, name=name_or_path, reuse_prompt_prefix=reuse_prompt_prefix, cpu_kernels=cpu_kernels)

    # ------------------------------------------------------------------ requests
    def start(self, prompts: list[list[int]], keep_hidden: bool = False, scored: list[list[bool]] | None = None) -> TreeBatch:
        """Into a fresh KV cache, reusing cached prompts' prefixes.

        Prompts that share a long prefix with an earlier prompt of the same batch (several questions on one
        context) are encoded in a second forward, after that prompt, so they reuse its KV instead of recomputing it.
        """
        self._piece_cache.clear()
        later = self.prefix_cache.followers(prompts, with_nll=scored is not None) if self.prefix_cache else []
        first = [i for i in range(len(prompts)) if i not in later]
        pick = (lambda rows: [scored[i] for i in rows]) if scored is not None else (lambda rows: None)
        batch = self._encode_rows([prompts[i] for i in first], keep_hidden, pick(first))
        if later:
            batch.extend(self._encode_rows([prompts[i] for i in later], keep_hidden, pick(later)))
            position = {row: k for k, row in enumerate(first + later)}
            batch.reorder([position[i] for i in range(len(prompts))])
        return batch

    def _encode_rows(self, prompts: list[list[int]], keep_hidden: bool, scored: list[list[bool]] | None) -> TreeBatch:
        return prefill(self.runner, prompts, self.pad_token_id, self.prefix_cache, keep_hidden, scored)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def context_window_of(config) -> int:
    """The longest sequence a model of this config reads (2048 where the config does not say)."""
    text_config = _text_config(config)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
