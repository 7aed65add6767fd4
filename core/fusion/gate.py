"""A learned fusion gate: AdaFuse's commit-or-explore decision made by a small policy instead of τΔ.

At the first token of each word, for each model, the gate reads that model's state (its final hidden state,
projected, and the entropy, top-2 margin and top-1 probability of its next-token distribution, the remaining
token budget and the words already in the span) and picks "commit" (keep going greedily; at a round's first
word, no exploration) or "explore" (at a round's first word, branch on the top-B first tokens; later, end the
span). `adafuse.training.gate` trains it with REINFORCE on task correctness minus a cost per forward pass, so it learns where
exploring and short spans pay for the compute they take (AdaFuse's τΔ needs per-task tuning instead).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..backend import Backend
from ..config import DecodingMode, FusionConfig
from ..sampling.policies import DecodingPolicy, PolicyCache, mlp, next_token_features

__all__ = ["COMMIT", "EXPLORE", "FusionGate", "GateDecision", "GateSession", "gate_session"]

COMMIT, EXPLORE = 1, 0


class FusionGate(DecodingPolicy):
    """Per model and word start: logits over (explore, commit) from the model's hidden state and step features."""

    kind = "fusion_gate"
    num_features = 5

    def __init__(self, hidden_sizes: list[int], model_names: list[str] | None = None, projection: int = 16,
                 hidden: int = 64, base_model: str = ""):
        super().__init__()
        self.hidden_sizes, self.projection_size, self.hidden = list(hidden_sizes), projection, hidden
        self.model_names = list(model_names or [])
        self.base_model = base_model or ",".join(self.model_names)
        self.project = nn.ModuleList(nn.Linear(size, projection) for size in self.hidden_sizes)
        self.policy = mlp(projection + len(self.hidden_sizes) + self.num_features, hidden, 2)

    @staticmethod
    def step_features(logprobs: torch.Tensor, remaining: torch.Tensor, words: torch.Tensor, max_words: int) -> torch.Tensor:
        """[n, 5]: entropy / log V, top-2 margin, top-1 probability, remaining budget (0..1), words in span / M."""
        return torch.cat([next_token_features(logprobs), remaining.float()[:, None], words.float()[:, None] / max_words], dim=-1)

    def forward(self, model_index: int, hidden_states: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        which = torch.zeros((len(features), len(self.hidden_sizes)), device=features.device)
        which[:, model_index] = 1.0
        projected = torch.tanh(self.project[model_index](hidden_states.float()))
        return self.policy(torch.cat([projected, which, features.float()], dim=-1))

    def config(self) -> dict[str, Any]:
        return {"hidden_sizes": self.hidden_sizes, "model_names": self.model_names, "projection": self.projection_size,
                "hidden": self.hidden, "base_model": self.base_model}


@dataclass
class GateDecision:
    """What the gate saw and chose once (kept for training)."""

    model_index: int
    hidden: torch.Tensor
    features: torch.Tensor
    action: int


@dataclass
class GateSession:
    """A gate in use for one decoding call: argmax decisions, or sampled ones recorded per prompt for training."""

    gate: FusionGate
    sample: bool = False
    generator: torch.Generator | None = None
    decisions: dict[int, list[GateDecision]] = field(default_factory=dict)

    @torch.inference_mode()
    def decide(self, model_index: int, hidden: torch.Tensor, logprobs: torch.Tensor, remaining: torch.Tensor,
               words: torch.Tensor, max_words: int) -> tuple[list[bool], list[GateDecision]]:
        """Commit (True) or explore for each of n states, and, when sampling for training, the decisions made
        (copied off the hot path otherwise)."""
        features = FusionGate.step_features(logprobs, remaining, words, max_words)
        policy = torch.softmax(self.gate(model_index, hidden, features), dim=-1)
        actions = torch.multinomial(policy, 1, generator=self.generator).flatten() if self.sample else policy.argmax(-1)
        actions = actions.tolist()
        if not self.sample:
            return [a == COMMIT for a in actions], []
        decisions = [GateDecision(model_index, h.float().cpu(), f.cpu(), a) for h, f, a in zip(hidden, features, actions)]
        return [a == COMMIT for a in actions], decisions


def gate_session(policies: PolicyCache, config: FusionConfig, backends: list[Backend]) -> GateSession | None:
    """A session of the learned gate named by `config.fusion_gate` (loaded once), checked against `backends`."""
    if config.fusion_gate is None or config.decoding_mode() is not DecodingMode.WORD_FUSION:
        return None
    blind = [b.name for b in backends if b.hidden_size is None]
    if blind:
        raise ValueError(f"the fusion gate reads hidden states, which model(s) {blind} cannot return (served remotely)")
    gate = policies.get(FusionGate, config.fusion_gate)
    sizes = [b.hidden_size for b in backends]
    if gate.hidden_sizes != sizes:
        raise ValueError(
            f"fusion gate {config.fusion_gate!r} was trained for models {gate.model_names or gate.hidden_sizes} "
            f"(hidden sizes {gate.hidden_sizes}), not these ({[b.name for b in backends]}, hidden sizes {sizes})"
        )
    return GateSession(gate)
