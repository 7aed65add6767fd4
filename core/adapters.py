"""Learned decoding adapters (arXiv 2603.09065): small MLP policies over a frozen model, trained by REINFORCE.

A `SequenceAdapter` maps a prompt embedding and a parallel-sample budget to one of a few decoding
configurations; a `TokenAdapter` maps a step's hidden state, entropy, top-2 margin and remaining budget to a
temperature. This module holds the policies and the pieces of their training that do not touch a model:
greedy-coverage selection of the action set, the REINFORCE loss with a baseline, the filter for prompts
whose rewards carry no signal, and the mask of confident steps.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .files import write_atomically, write_text_atomically

__all__ = [
    "SHIPPED",
    "SamplingChoice",
    "SequenceAdapter",
    "TokenAdapter",
    "confident_step_mask",
    "greedy_coverage",
    "informative_prompts",
    "load_checkpoint",
    "policy_step",
    "reinforce_loss",
    "save_checkpoint",
]


SHIPPED = Path(__file__).resolve().parent / "adapter_weights"
"""Adapters trained for the embedded default models, shipped with the package (see each training.json)."""


@dataclass(frozen=True)
class SamplingChoice:
    """One decoding configuration an adapter can pick; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def greedy_coverage(rewards: torch.Tensor, size: int) -> list[int]:
    """Pick `size` configurations (columns) that together solve the most prompts (rows) at best-of-S.

    Each step adds the configuration that newly solves the most prompts, ties broken by total reward.
    """
    solved = rewards.bool()
    covered = torch.zeros(solved.shape[0], dtype=torch.bool)
    chosen: list[int] = []
    for _ in range(min(size, solved.shape[1])):
        gains = (solved & ~covered[:, None]).sum(0).double() + solved.sum(0).double() / (solved.shape[0] + 1)
        gains[chosen] = -1.0
        best = int(gains.argmax())
        chosen.append(best)
        covered |= solved[:, best]
    return chosen


def informative_prompts(rewards: torch.Tensor) -> torch.Tensor:
    """Rows whose rewards differ across actions/samples; constant rows give REINFORCE no signal."""
    flat = rewards.reshape(rewards.shape[0], -1).float()
    return (flat.max(dim=1).values - flat.min(dim=1).values) > 0


def confident_step_mask(max_probs: torch.Tensor, threshold: float = 0.95) -> torch.Tensor:
    """Steps to learn from: those where the model's top token probability is at most `threshold`."""
    return max_probs <= threshold


def reinforce_loss(action_logprobs: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor | None = None,
                   baseline: torch.Tensor | float | None = None) -> torch.Tensor:
    """Policy-gradient loss -(r - b) log π(a), averaged over unmasked entries; b defaults to the mean reward."""
    rewards = rewards.float()
    mask = torch.ones_like(rewards, dtype=torch.bool) if mask is None else mask.bool()
    if baseline is None:
        baseline = rewards[mask].mean() if mask.any() else 0.0
    advantage = (rewards - baseline).detach()
    return -(advantage * action_logprobs * mask).sum() / mask.sum().clamp(min=1)


def load_checkpoint(path: Path | None, policy: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, list[dict]]:
    """Resume training from `path` if it exists: restore policy and optimizer; return (steps done, history).

    The checkpoint is safetensors (tensors) with its structure as JSON metadata: loading it runs no code.
    """
    if path is None or not Path(path).exists():
        return 0, []
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
            state = _with_tensors(json.loads(handle.metadata()["state"]), tensors)
        policy.load_state_dict(state["policy"])
        optimizer.load_state_dict(state["optimizer"])
    except Exception as error:
        raise ValueError(f"{path}: not a training checkpoint this version can resume from ({error}); "
                         "delete it to start training afresh") from error
    return state["step"], state["history"]


def policy_step(optimizer: torch.optim.Optimizer, losses: list[torch.Tensor]) -> float:
    """One optimizer step on the mean of `losses`; returns that mean (0.0, and no step, when there are none)."""
    if not losses:
        return 0.0
    loss = torch.stack(losses).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def save_checkpoint(path: Path | None, policy: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    history: list[dict]) -> None:
    """Write what `load_checkpoint` resumes from (nothing when `path` is None), replacing the old one atomically."""
    if path is None:
        return
    tensors: dict[str, torch.Tensor] = {}
    state = {"policy": policy.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "history": history}
    metadata = {"state": json.dumps(_without_tensors(state, "", tensors))}
    write_atomically(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))


def _without_tensors(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON, its tensors moved into `tensors` under their path; dicts keep their key types."""
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().contiguous()
        return {"tensor": key}
    if isinstance(value, dict):
        return {"items": [[k, _without_tensors(v, f"{key}.{k}", tensors)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [_without_tensors(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    return value


def _with_tensors(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "tensor" in value:
            return tensors[value["tensor"]]
        return {k: _with_tensors(v, tensors) for k, v in value["items"]}
    if isinstance(value, list):
        return [_with_tensors(v, tensors) for v in value]
    return value


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    """The paper's 3-layer MLP policy head."""
    return nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, outputs))


class _Adapter(nn.Module):
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
    def load(cls, folder: str | Path) -> "_Adapter":
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
    def from_name(cls, name_or_path: str) -> "_Adapter":
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
    def _from_config(cls, config: dict[str, Any]) -> "_Adapter":
        return cls(**config)


class SequenceAdapter(_Adapter):
    """Contextual bandit: prompt embedding + sample budget B -> softmax over a set of decoding configurations."""

    kind = "sequence"

    def __init__(self, embed_dim: int, choices: list[SamplingChoice], hidden: int = 128, base_model: str = ""):
        super().__init__()
        if not choices:
            raise ValueError("a SequenceAdapter needs at least one decoding configuration")
        self.embed_dim, self.hidden, self.base_model = embed_dim, hidden, base_model
        self.choices = list(choices)
        self.policy = _mlp(embed_dim + 1, hidden, len(self.choices))

    def forward(self, embeddings: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
        """Logits over configurations for [n, embed_dim] prompt embeddings and [n] sample budgets."""
        budget_feature = torch.log2(budgets.float().clamp(min=1))[:, None]
        return self.policy(torch.cat([embeddings.float(), budget_feature], dim=-1))

    @torch.no_grad()
    def choose(self, embedding: torch.Tensor, budget: int) -> SamplingChoice:
        """The most likely configuration for one prompt and budget."""
        logits = self(embedding[None], torch.tensor([budget]))
        return self.choices[int(logits.argmax())]

    def config(self) -> dict[str, Any]:
        return {"embed_dim": self.embed_dim, "hidden": self.hidden, "base_model": self.base_model,
                "choices": [asdict(c) for c in self.choices]}

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> "SequenceAdapter":
        return cls(**{**config, "choices": [SamplingChoice(**c) for c in config["choices"]]})


class TokenAdapter(_Adapter):
    """POMDP policy: per step, hidden state (projected) + entropy + top-2 margin + remaining budget -> temperature."""

    kind = "token"

    def __init__(self, hidden_size: int, temperatures: tuple[float, ...] = (0.0, 0.3, 0.7, 1.0),
                 projection: int = 64, hidden: int = 64, base_model: str = ""):
        super().__init__()
        self.hidden_size, self.projection_size, self.hidden, self.base_model = hidden_size, projection, hidden, base_model
        self.temperatures = tuple(float(t) for t in temperatures)
        self.project = nn.Linear(hidden_size, projection)
        self.policy = _mlp(projection + 3, hidden, len(self.temperatures))

    @staticmethod
    def step_features(logprobs: torch.Tensor, remaining_fraction: torch.Tensor) -> torch.Tensor:
        """Entropy (normalised by log V), top-2 margin and remaining token budget (0..1) of [n, V] log-probs."""
        probs = logprobs.exp()
        entropy = -(probs * logprobs).sum(-1) / math.log(logprobs.shape[-1])
        top = probs.topk(2, dim=-1).values
        return torch.stack([entropy, top[:, 0] - top[:, 1], remaining_fraction.float()], dim=-1)

    def forward(self, hidden_states: torch.Tensor, step_features: torch.Tensor) -> torch.Tensor:
        """Logits over temperatures for [n, hidden_size] states and [n, 3] step features."""
        return self.policy(torch.cat([torch.tanh(self.project(hidden_states.float())), step_features], dim=-1))

    def config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden_size, "temperatures": list(self.temperatures), "projection": self.projection_size,
                "hidden": self.hidden, "base_model": self.base_model}
