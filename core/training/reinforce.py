"""The parts of REINFORCE training that do not touch a model: greedy-coverage selection of an action set, the
policy-gradient loss with a baseline, the filter for prompts whose rewards carry no signal, the mask of confident
steps, one optimizer step, and resumable checkpoints that run no code when loaded."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..files import write_atomically

__all__ = [
    "confident_step_mask", "greedy_coverage", "informative_prompts", "load_checkpoint", "policy_step",
    "reinforce_loss", "save_checkpoint", "taken_action_logprobs",
]


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


def taken_action_logprobs(logits: torch.Tensor, actions: list[int]) -> torch.Tensor:
    """Log-probability of each row's taken action under [n, actions] policy logits."""
    return torch.log_softmax(logits, -1)[torch.arange(len(actions)), torch.tensor(actions)]
