"""Single-model sampling whose configuration is chosen per prompt by a SequenceAdapter and whose temperature is
chosen per step by a TokenAdapter (arXiv 2603.09065), with majority voting over parallel samples.

The sampler runs on the same KV-tree core as AdaFuse (batched rows, prompt-prefix reuse, exact masks).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..answers import first_line_answer
from ..backend import ModelBackend
from ..config import FusionConfig, SamplingFilter
from ..result import DecodingStats, GenerationResult
from .filters import filtered_probs
from .policies import PolicyCache, SequenceAdapter, TokenAdapter

__all__ = ["GREEDY", "AdaptiveSampler", "Rollout", "majority_answer", "majority_index", "prompt_embeddings",
           "sample_adaptively", "sampling_policies"]

GREEDY = SamplingFilter()


@dataclass
class Rollout:
    """One sampled completion and, for training, what the policy saw and did at each step."""

    text: str
    finish_reason: str
    new_tokens: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    max_probs: list[float] = field(default_factory=list)


class AdaptiveSampler:
    """Decode a batch of prompts with one model, sampling each step at a fixed or adapter-chosen temperature."""

    def __init__(self, backend: ModelBackend, adapter: TokenAdapter | None = None):
        self.backend, self.adapter = backend, adapter

    def sample(self, prompts: list[str], *, choice: SamplingFilter | list[SamplingFilter] = GREEDY, max_new_tokens: int = 64,
               stop: tuple[str, ...] = (), generator: torch.Generator | None = None, explore: bool = False,
               samples_per_prompt: int = 1, max_batch_rows: int | None = None, min_new_tokens: int = 0) -> list[Rollout]:
        """`samples_per_prompt` rollouts of each prompt (prompt-major), sharing its prefill. `choice` is one
        configuration or one per prompt. With an adapter, its policy picks each step's temperature (sampled
        when `explore`, else argmax). At most `max_batch_rows` rows decode together (default: all); no rollout ends
        before `min_new_tokens` tokens."""
        choices = list(choice) if isinstance(choice, list) else [choice] * len(prompts)
        per_batch = max(1, (max_batch_rows or len(prompts) * samples_per_prompt) // samples_per_prompt)
        return [
            rollout
            for start in range(0, len(prompts), per_batch)
            for rollout in self._sample_batch(prompts[start:start + per_batch], choices[start:start + per_batch],
                                              max_new_tokens, min_new_tokens, stop, generator, explore, samples_per_prompt)
        ]

    @torch.inference_mode()
    def _sample_batch(self, prompts: list[str], choices: list[SamplingFilter], max_new_tokens: int, min_new_tokens: int,
                      stop: tuple[str, ...], generator: torch.Generator | None, explore: bool,
                      samples_per_prompt: int) -> list[Rollout]:
        backend = self.backend
        row_choices = [c for c in choices for _ in range(samples_per_prompt)]
        batch = backend.start([backend.encode_prompt(p) for p in prompts], keep_hidden=self.adapter is not None)
        if samples_per_prompt > 1:
            batch.repeat_rows(samples_per_prompt)
        rollouts = [Rollout("", "length") for _ in row_choices]
        generated: list[list[int]] = [[] for _ in row_choices]
        active = list(range(len(row_choices)))
        for step in range(max_new_tokens):
            logprobs = torch.stack(batch.root_logprobs)
            if step < min_new_tokens:
                logprobs = backend.without_end(logprobs)
            temperatures = self._temperatures(batch, logprobs, 1 - step / max_new_tokens, [rollouts[r] for r in active],
                                              explore, generator, [row_choices[r] for r in active])
            spans: list[list[int] | None] = []
            for position, r in enumerate(active):
                token = self._pick(logprobs[position], temperatures[position], row_choices[r], generator)
                rollout = rollouts[r]
                rollout.max_probs.append(float(logprobs[position].max().exp()))
                if token in backend.end_ids:
                    rollout.finish_reason = "eos"
                else:
                    generated[r].append(token)
                    rollout.new_tokens += 1
                    rollout.text = backend.decode(generated[r])
                    hits = [i for i in (rollout.text.find(s) for s in stop) if i >= 0]
                    if hits:
                        rollout.text, rollout.finish_reason = rollout.text[: min(hits)], "stop"
                done = rollout.finish_reason != "length" or step == max_new_tokens - 1
                if done and rollout.finish_reason == "length":  # the budget may end inside a character's bytes
                    rollout.text = backend.truncate(rollout.text, max_new_tokens)
                spans.append(None if done else [token])
            batch.commit(spans)
            active = [r for r, span in zip(active, spans) if span is not None]
            if not active:
                break
        return rollouts

    def _temperatures(self, batch, logprobs, remaining: float, rollouts: list[Rollout], explore: bool,
                      generator: torch.Generator | None, choices: list[SamplingFilter]) -> list[float]:
        if self.adapter is None:
            return [c.temperature for c in choices]
        hidden = torch.stack(batch.root_hidden).float()
        features = TokenAdapter.step_features(logprobs, torch.full((len(rollouts),), remaining))
        policy = torch.softmax(self.adapter(hidden, features), dim=-1)
        actions = torch.multinomial(policy, 1, generator=generator).flatten() if explore else policy.argmax(-1)
        for rollout, state, feature, action in zip(rollouts, hidden, features, actions.tolist()):
            rollout.hidden.append(state)
            rollout.features.append(feature)
            rollout.actions.append(action)
        return [self.adapter.temperatures[a] for a in actions.tolist()]

    @staticmethod
    def _pick(logprobs: torch.Tensor, temperature: float, choice: SamplingFilter, generator: torch.Generator | None) -> int:
        if temperature <= 0:
            return int(logprobs.argmax())
        settings = SamplingFilter(temperature, choice.top_k, choice.top_p, choice.min_p)
        return int(torch.multinomial(filtered_probs(logprobs, settings), 1, generator=generator))


@torch.inference_mode()
def prompt_embeddings(backend: ModelBackend, prompts: list[str]) -> torch.Tensor:
    """Mean-pooled final hidden state of each prompt under the frozen model: the sequence adapter's context."""
    embeddings = []
    for prompt in prompts:
        ids = torch.tensor([backend.encode_prompt(prompt)], device=backend.model.device)
        hidden = backend.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        embeddings.append(hidden[0].float().mean(0).cpu())
    return torch.stack(embeddings)


def majority_index(completions: list[str]) -> int:
    """Index of the earliest sample whose answer is the most frequent among parallel samples."""
    answers = [first_line_answer(c) for c in completions]
    return max(range(len(answers)), key=lambda i: (answers.count(answers[i]), -i))


def majority_answer(completions: list[str]) -> str:
    """The most frequent answer among parallel samples (earliest wins ties)."""
    return first_line_answer(completions[majority_index(completions)]) if completions else ""


def sampling_policies(policies: PolicyCache, config: FusionConfig, backends: list[ModelBackend]
                      ) -> tuple[ModelBackend, TokenAdapter | None, SequenceAdapter | None] | None:
    """The decoding adapters named by `config` (loaded once) and the one of `backends` they were trained for."""
    if not config.samples_adaptively:
        return None
    token = policies.get(TokenAdapter, config.token_adapter) if config.token_adapter else None
    sequence = policies.get(SequenceAdapter, config.sequence_adapter) if config.sequence_adapter else None
    bases = sorted({a.base_model for a in (token, sequence) if a is not None})
    if len(bases) > 1:
        raise ValueError(f"token_adapter and sequence_adapter were trained for different models: {bases}")
    backend = next((b for b in backends if b.name == bases[0]), None)
    if backend is None:
        raise ValueError(f"the decoding adapter was trained for model {bases[0]!r}, which is not one of "
                         f"{[b.name for b in backends]}")
    if not isinstance(backend, ModelBackend):
        raise ValueError(f"decoding adapters read hidden states, which model {backend.name!r} cannot return (served "
                         "remotely); load it in process")
    sizes = ([token.hidden_size] if token else []) + ([sequence.embed_dim] if sequence else [])
    if any(size != backend.hidden_size for size in sizes):
        raise ValueError(f"the decoding adapter's input size {sizes} does not match model {backend.name!r} "
                         f"(hidden size {backend.hidden_size})")
    return backend, token, sequence


def sample_adaptively(backend: ModelBackend, token: TokenAdapter | None, sequence: SequenceAdapter | None,
                      texts: list[str], config: FusionConfig, max_batch_size: int | None) -> Iterator[tuple[int, str | GenerationResult]]:
    """Each rendered prompt's majority-voted answer of `num_samples` samples, as (prompt index, text) then (prompt
    index, result): the sequence adapter picks each prompt's sampling configuration, the token adapter each step's
    temperature."""
    started = time.perf_counter()
    backend.reset_counters()
    if sequence is not None:
        choices = [sequence.choose(e, config.num_samples) for e in prompt_embeddings(backend, texts)]
    else:
        choices = [dataclasses.replace(config.sampling_filter, temperature=0.0)] * len(texts)
    rollouts = AdaptiveSampler(backend, token).sample(
        texts, choice=choices, max_new_tokens=config.max_new_tokens, min_new_tokens=config.min_new_tokens, stop=tuple(config.stop),
        generator=torch.Generator(device=backend.model.device).manual_seed(config.seed),
        samples_per_prompt=config.num_samples,
        max_batch_rows=max_batch_size and max_batch_size * config.num_samples,
    )
    counters = backend.reset_counters()
    elapsed = time.perf_counter() - started
    for r in range(len(texts)):
        samples = rollouts[r * config.num_samples:(r + 1) * config.num_samples]
        voted = samples[majority_index([s.text for s in samples])]
        stats = DecodingStats(
            rounds=max(s.new_tokens for s in samples), new_tokens=voted.new_tokens, batch_size=len(texts),
            forward_passes={backend.name: counters["forward_passes"]},
            tokens_processed={backend.name: counters["tokens"]}, wall_time_s=elapsed,
        )
        if voted.text:
            yield r, voted.text
        yield r, GenerationResult(voted.text, voted.finish_reason, stats)
