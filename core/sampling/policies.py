"""Learned decoding adapters (arXiv 2603.09065): small MLP policies over a frozen model.

A `SequenceAdapter` maps a prompt embedding and a parallel-sample budget to one of a few decoding
configurations; a `TokenAdapter` maps a step's hidden state, entropy, top-2 margin and remaining budget to a
temperature. `DecodingPolicy` is what every learned policy shares (the fusion gate too): saving and loading as
safetensors plus JSON, shipped policies by name, and the features of a next-token distribution they read.
Their training is in `adafuse.training`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import SamplingFilter
from ..files import write_atomically, write_text_atomically

__all__ = ["SHIPPED", "DecodingPolicy", "PolicyCache", "SequenceAdapter", "TokenAdapter", "next_token_features"]


SHIPPED = Path(__file__).resolve().parents[1] / "adapter_weights"
"""Adapters trained for the embedded default models, shipped with the package (see each training.json)."""


def next_token_features(logprobs: torch.Tensor) -> torch.Tensor:
    """[n, 3] of [n, V] log-probs: entropy (normalised by log V), top-2 probability margin, top-1 probability."""
    probs = logprobs.exp()
    entropy = -(probs * logprobs).sum(-1) / math.log(logprobs.shape[-1])
    top = probs.topk(2, dim=-1).values
    return torch.stack([entropy, top[:, 0] - top[:, 1], top[:, 0]], dim=-1)


def mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    """The paper's 3-layer MLP policy head."""
    return nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, outputs))


class DecodingPolicy(nn.Module):
    """Save/load as safetensors weights plus a JSON config that names the frozen base model."""

    kind = ""

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        weights = {k: v.contiguous() for k, v in self.state_dict().items()}
        write_atomically(folder / "adapter.safetensors", lambda temporary: save_file(weights, str(temporary)))
        write_text_atomically(folder / "adapter_config.json", json.dumps({"kind": self.kind, **self.config()}, indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> "DecodingPolicy":
        folder = Path(folder)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except FileNotFoundError as error:
            raise FileNotFoundError(f"no adapter at {folder}: adapter_config.json is missing") from error
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{folder}/adapter_config.json is not valid JSON ({error}); save the adapter again") from None
        kind = config.pop("kind", None) if isinstance(config, dict) else None
        if kind != cls.kind:
            raise ValueError(f"{folder} does not hold a {cls.kind} adapter (its adapter_config.json says kind={kind!r})")
        try:
            adapter = cls._from_config(config)
            adapter.load_state_dict(load_file(str(folder / "adapter.safetensors")))
        except Exception as error:  # a missing or damaged file, or weights of another shape
            raise ValueError(f"{folder}: the {cls.kind} adapter cannot be loaded ({error.__class__.__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else ''}); save it again") from error
        return adapter.eval()

    @classmethod
    def from_name(cls, name_or_path: str) -> "DecodingPolicy":
        """From a folder, or by the name of one shipped in `adafuse/adapter_weights`."""
        folder = Path(name_or_path)
        if not folder.exists() and (SHIPPED / name_or_path).exists():
            folder = SHIPPED / name_or_path
        if not (folder / "adapter_config.json").exists():
            raise FileNotFoundError(
                f"no {cls.kind.replace('_', ' ')} adapter at {name_or_path!r}: give a folder saved by {cls.__name__}.save "
                f"or one of {cls.shipped()}"
            )
        return cls.load(folder)

    @classmethod
    def shipped(cls) -> list[str]:
        """Names of the shipped adapters of this kind."""
        folders = sorted(SHIPPED.glob("*/adapter_config.json")) if SHIPPED.exists() else []
        return [f.parent.name for f in folders if json.loads(f.read_text()).get("kind") == cls.kind]

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> "DecodingPolicy":
        return cls(**config)


class SequenceAdapter(DecodingPolicy):
    """Contextual bandit: prompt embedding + sample budget B -> softmax over a set of decoding configurations."""

    kind = "sequence"

    def __init__(self, embed_dim: int, choices: list[SamplingFilter], hidden: int = 128, base_model: str = ""):
        super().__init__()
        if not choices:
            raise ValueError("a SequenceAdapter needs at least one decoding configuration")
        self.embed_dim, self.hidden, self.base_model = embed_dim, hidden, base_model
        self.choices = list(choices)
        self.policy = mlp(embed_dim + 1, hidden, len(self.choices))

    def forward(self, embeddings: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """Logits over configurations for [n, embed_dim] prompt embeddings and [n] sample budgets."""
        budget_feature = torch.log2(budgets.float().clamp(min=1))[:, None]
        return self.policy(torch.cat([embeddings.float(), budget_feature], dim=-1))

    @torch.no_grad()
    def choose(self, embedding: torch.Tensor, budget: int) -> SamplingFilter:
        """The most likely configuration for one prompt and budget."""
        logits = self(embedding[None], torch.tensor([budget]))
        return self.choices[int(logits.argmax())]

    def config(self) -> dict[str, Any]:
        return {"embed_dim": self.embed_dim, "hidden": self.hidden, "base_model": self.base_model,
                "choices": [asdict(c) for c in self.choices]}

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> "SequenceAdapter":
        return cls(**{**config, "choices": [SamplingFilter(**c) for c in config["choices"]]})


class TokenAdapter(DecodingPolicy):
    """POMDP policy: per step, hidden state (projected) + entropy + top-2 margin + remaining budget -> temperature."""

    kind = "token"

    def __init__(self, hidden_size: int, temperatures: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0),
                 projection: int = 64, hidden: int = 64, base_model: str = ""):
        super().__init__()
        self.hidden_size, self.projection_size, self.hidden, self.base_model = hidden_size, projection, hidden, base_model
        self.temperatures = tuple(float(t) for t in temperatures)
        self.project = nn.Linear(hidden_size, projection)
        self.policy = mlp(projection + 3, hidden, len(self.temperatures))

    @staticmethod
    def step_features(logprobs: torch.Tensor, remaining_fraction: torch.Tensor) -> torch.Tensor:
        """Entropy (normalised by log V), top-2 margin and remaining token budget (0..1) of [n, V] log-probs."""
        return torch.cat([next_token_features(logprobs)[:, :2], remaining_fraction.float()[:, None]], dim=-1)

    def forward(self, hidden_states: torch.Tensor, step_features: torch.Tensor) -> torch.Tensor:
        """Logits over temperatures for [n, hidden_size] states and [n, 3] step features."""
        return self.policy(torch.cat([torch.tanh(self.project(hidden_states.float())), step_features], dim=-1))

    def config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "temperatures": list(self.temperatures), "projection": self.projection_size,
                "hidden": self.hidden, "base_model": self.base_model}


class PolicyCache:
    """Policies loaded by folder or shipped name, each once per engine."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str], DecodingPolicy] = {}

    def get(self, kind: type[DecodingPolicy], name: str) -> DecodingPolicy:
        policy = self._loaded.get((kind.kind, name))
        if policy is None:
            policy = self._loaded[(kind.kind, name)] = kind.from_name(name)
        return policy
