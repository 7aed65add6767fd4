"""Running one frozen causal LM over a KV cache: the forward, its attention masks and its output head.

Hardware kernels installed at load (`adafuse.kernels`) may ask every forward for something (a minimum number of
rows, the positions that are real tokens); they say so through a `ForwardTuning`, so this module never imports
them and runs the same on every device.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

__all__ = ["ForwardTiming", "ForwardTuning", "ModelRunner", "OutputHead", "cache_argument"]


def _no_context(real: torch.Tensor) -> AbstractContextManager:
    return nullcontext()


@dataclass(frozen=True)
class ForwardTuning:
    """What the kernels a model runs on ask of each forward: pad a scratch step to at least `min_rows` token rows,
    and run the forward inside `real_tokens(mask of the real positions)`. The default asks nothing."""

    min_rows: int = 1
    real_tokens: Callable[[torch.Tensor], AbstractContextManager] = _no_context


@dataclass(frozen=True)
class ForwardTiming:
    """One forward, as a `ModelRunner.on_forward` callback sees it."""

    model_type: str
    kind: str  # "prefill" or "step"
    rows: int
    tokens_per_row: int
    seconds: float


@dataclass(frozen=True)
class ForwardOutput:
    """Log-distributions at the wanted positions (row-major), their final-layer states when kept, and each
    position's NLL of its target when targets were given (batch x width, NaN elsewhere)."""

    logprobs: torch.Tensor
    hidden: torch.Tensor | None = None
    target_nll: torch.Tensor | None = None


@dataclass
class OutputHead:
    """A causal LM split into its decoder stack and its output projection.

    Over a large vocabulary the projection costs as much as the rest of a small model (Gemma 3 270M: 168M of
    its 268M weights), so it is applied only at the positions whose next-token distribution is needed, not
    at padding.
    """

    decoder: torch.nn.Module
    projection: torch.nn.Module
    softcap: float | None = None

    @classmethod
    @torch.inference_mode()
    def of(cls, model: PreTrainedModel) -> "OutputHead | None":
        """Split `model`, or None where its logits are not the projection of its decoder's output (checked)."""
        decoder, projection = model.get_decoder(), model.get_output_embeddings()
        if decoder is model or projection is None:
            return None
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head = cls(decoder, projection, getattr(text_config, "final_logit_softcapping", None))
        probe = torch.arange(1, 4, device=model.device)[None]
        try:
            expected = model(input_ids=probe, use_cache=False).logits
            split = head.logits(decoder(input_ids=probe, use_cache=False).last_hidden_state)
        except (TypeError, AttributeError, ValueError):
            return None
        return head if torch.allclose(expected.float(), split.float(), atol=1e-4, rtol=1e-3) else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.projection(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ModelRunner:
    """One model's forward over a shared KV cache, counting its passes and tokens in `counters`.

    `on_forward`, when set, is called with a `ForwardTiming` after every forward (benchmarks time them this way).
    """

    def __init__(self, model: PreTrainedModel, counters: dict[str, int], tuning: ForwardTuning | None = None,
                 head: OutputHead | None = None):
        self.model, self.counters, self.head = model, counters, head
        self.tuning = tuning or ForwardTuning()
        self.device = model.device
        self.window, self.layer_types = _attention_layout(model.config)
        self.on_forward: Callable[[ForwardTiming], None] | None = None

    def step_width(self, rows: int, width: int) -> int:
        """Tokens per row for a scratch step of `rows` rows needing `width`: padded where the kernels ask for more."""
        if 1 < rows * width < self.tuning.min_rows:
            return -(-self.tuning.min_rows // rows)
        return width

    def run(self, cache: DynamicCache, input_ids: torch.Tensor, mask, positions: torch.Tensor, wanted: torch.Tensor,
            real: torch.Tensor, *, keep_hidden: bool = False, targets: torch.Tensor | None = None,
            kind: str = "step") -> ForwardOutput:
        """Forward new tokens (`real` marks them among the padding) into `cache`; log-distributions at the `wanted`
        positions (bool, batch x width). With `targets` (the token each position predicts, -1 for none), also each
        position's NLL of its target."""
        started = time.perf_counter()
        inputs = {
            "input_ids": input_ids.to(self.device),
            "attention_mask": mask.to(self.device) if isinstance(mask, torch.Tensor) else mask,
            "position_ids": positions.to(self.device),
            "use_cache": True,
        }
        wanted = wanted.to(self.device)
        target_nll = None
        with self.tuning.real_tokens(real.cpu()):
            if self.head is not None:
                states = self.head.decoder(**inputs, **{cache_argument(self.head.decoder): cache}).last_hidden_state
                hidden = states[wanted]
                logits = self.head.logits(hidden)
                if targets is not None:
                    target_nll = _target_nll(states, targets.to(self.device), self.head.logits)
            else:
                keep = input_ids.shape[1] if targets is not None else input_ids.shape[1] - int(wanted.any(0).nonzero().min())
                output = self.model(**inputs, logits_to_keep=keep, output_hidden_states=keep_hidden,
                                    **{cache_argument(self.model): cache})
                logits = output.logits[wanted[:, -keep:]]
                if targets is not None:
                    target_nll = _target_nll(output.logits, targets.to(self.device), lambda x: x)
                hidden = output.hidden_states[-1][wanted] if keep_hidden else None
        self.counters["forward_passes"] += 1
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if self.on_forward is not None:
            self.on_forward(ForwardTiming(self.model.config.model_type, kind, *input_ids.shape,
                                          time.perf_counter() - started))
        return ForwardOutput(logprobs, hidden if keep_hidden else None, target_nll)

    def attention_masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
        """Additive masks from `allowed` (batch x queries x keys), with the model's sliding window where it has one."""
        allowed = allowed.to(self.device)
        dtype = self.model.dtype
        blocked = torch.finfo(dtype).min

        def additive(keep: torch.Tensor) -> torch.Tensor:
            zero = torch.zeros((), dtype=dtype, device=self.device)
            return torch.where(keep, zero, torch.full((), blocked, dtype=dtype, device=self.device))[:, None]

        full = additive(allowed)
        if self.window is None:
            return full
        near = (query_positions.to(self.device)[:, :, None] - key_positions[:, None, :]) < self.window
        sliding = additive(allowed & near)
        if self.layer_types is None:
            return sliding
        return {kind: (sliding if kind == "sliding_attention" else full) for kind in self.layer_types}


def _target_nll(states: torch.Tensor, targets: torch.Tensor, logits_of, chunk: int = 256) -> torch.Tensor:
    """NLL of `targets` (-1: none) under the logits of `states` (batch x width x ...), a chunk of positions at a
    time: a large vocabulary's log-distribution at every prompt position would not fit in memory."""
    nll = torch.full(targets.shape, float("nan"), device=targets.device)
    where = (targets >= 0).nonzero(as_tuple=True)
    picked, wanted = states[where], targets[where]
    values = []
    for start in range(0, len(wanted), chunk):
        logits = logits_of(picked[start : start + chunk]).float()
        values.append(torch.logsumexp(logits, -1) - logits.gather(1, wanted[start : start + chunk, None])[:, 0])
    if values:
        nll[where] = torch.cat(values)
    return nll


def cache_argument(model: PreTrainedModel) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; use whichever this model's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _attention_layout(config) -> tuple[int | None, list[str] | None]:
    """Sliding window size and per-layer attention kinds, so custom masks match the model's own."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        kinds = sorted(set(layer_types))
        if "sliding_attention" not in kinds or not window:
            return None, None
        return window, (kinds if len(kinds) > 1 else None)
    if not window or not getattr(text_config, "use_sliding_window", True):
        return None, None
    return window, None
