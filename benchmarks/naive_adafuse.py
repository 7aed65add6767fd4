"""A naive reference implementation of the same AdaFuse algorithm, for speed comparisons only.

Like the published code it keeps no KV cache across calls and batches nothing: every word proposal
re-encodes the whole prefix, and every candidate is scored by one full forward over prefix + candidate,
one candidate and one model at a time. Tokenisation, gating, exploration, scoring and stopping follow
`adafuse.fusion` exactly, so the two must produce the same answers.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache

from adafuse import FusionConfig, ModelBackend
from adafuse.runtime.model_runner import cache_argument


class NaiveAdaFuse:
    def __init__(self, backends: list[ModelBackend], config: FusionConfig):
        self.backends, self.config = backends, config

    @torch.inference_mode()
    def _forward(self, backend: ModelBackend, ids: list[int], cache: DynamicCache | None = None) -> torch.Tensor:
        backend.counters["forward_passes"] += 1
        backend.counters["tokens"] += len(ids)
        logits = backend.model(torch.tensor([ids]), use_cache=cache is not None, **{cache_argument(backend.model): cache}).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    def _greedy_branch(self, backend: ModelBackend, prefix: list[int], first: int, explored: bool, margin: float, budget: int):
        """Finish one branch to whole words with a cache that lives for this proposal only."""
        config, ends = self.config, set(backend.end_ids)
        if first in ends:
            return [], True
        tokens, words, word_tokens = [first], 1, 1
        cache = DynamicCache()
        self._forward(backend, prefix, cache)
        while True:
            logprobs = self._forward(backend, [tokens[-1]], cache)[-1]
            top = logprobs.topk(2)
            token, next_margin = int(top.indices[0]), float(top.values.exp()[0] - top.values.exp()[1])
            if token in ends:
                return tokens, True
            if len(tokens) >= budget:
                return tokens, False
            if bool(backend.starts_word[token]):
                if config.fixed_span_words is not None:
                    go = words < config.fixed_span_words
                else:
                    go = not explored and margin >= config.tau_delta and words < config.max_span_words
                if not go:
                    return tokens, False
                words, word_tokens, margin = words + 1, 0, next_margin
            elif word_tokens >= config.max_word_tokens:
                return tokens, False
            tokens.append(token)
            word_tokens += 1

    def _propose(self, backend: ModelBackend, prefix: list[int], budget: int):
        root = self._forward(backend, prefix)[-1]
        top = root.topk(max(2, self.config.num_branches))
        probs = top.values.exp()
        margin = float(probs[0] - probs[1])
        gated = self.config.fixed_span_words is not None or margin >= self.config.tau_delta
        if gated or self.config.num_branches == 1:
            firsts, explored = [int(top.indices[0])], False
        else:
            firsts, explored = top.indices[: self.config.num_branches].tolist(), True
        return [self._greedy_branch(backend, prefix, f, explored, margin, budget) for f in firsts]

    def _nll(self, backend: ModelBackend, prefix: list[int], tokens: list[int], ends: bool) -> float:
        logprobs = self._forward(backend, prefix + tokens)[len(prefix) - 1:]
        total = sum(float(logprobs[i, t]) for i, t in enumerate(tokens))
        if ends:
            total += float(backend.end_logprob(logprobs[len(tokens)]))
        return -total / (len(tokens) + ends)

    @torch.inference_mode()
    def generate(self, prompt: str) -> tuple[str, str]:
        config = self.config
        ids = [b.encode_prompt(prompt) for b in self.backends]
        weights = torch.tensor(config.model_weights or [1.0] * len(self.backends))
        weights = (weights / weights.sum()).tolist()
        text, new_tokens, rounds = "", 0, 0
        while True:
            pool: dict[tuple[str, bool], None] = {}
            for backend, prefix in zip(self.backends, ids):
                for tokens, ends in self._propose(backend, prefix, config.max_new_tokens - new_tokens):
                    piece = backend.decode(tokens)
                    if piece or ends:
                        pool.setdefault((piece, ends), None)
            candidates = list(pool)
            if len(candidates) == 1:
                best = candidates[0]
            else:
                scores = [
                    sum(w * self._nll(b, p, b.encode_piece(c), e) for w, b, p in zip(weights, self.backends, ids))
                    for c, e in candidates
                ]
                best = candidates[min(range(len(candidates)), key=scores.__getitem__)]
            rounds += 1
            before, (piece, ends) = len(text), best
            text += piece
            new_tokens += len(self.backends[0].encode_piece(piece))
            longest = max((len(s) for s in config.stop), default=0)
            hits = [i for i in (text.find(s, max(0, before - longest + 1)) for s in config.stop) if i >= 0]
            if hits:
                return text[: min(hits)], "stop"
            if ends:
                return text, "eos"
            if new_tokens >= config.max_new_tokens or (config.max_rounds and rounds >= config.max_rounds):
                tokens = self.backends[0].encode_piece(text)
                return (text if len(tokens) <= config.max_new_tokens else self.backends[0].decode(tokens[: config.max_new_tokens])), "length"
            ids = [p + b.encode_piece(piece) for b, p in zip(self.backends, ids)]
