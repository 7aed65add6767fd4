"""REINFORCE training of the fusion gate on the fused decoder: reward = correct - cost x forward passes."""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from ..fusion.gate import COMMIT, FusionGate, GateDecision, GateSession
from .reinforce import (
    confident_step_mask, informative_prompts, load_checkpoint, policy_step, reinforce_loss, save_checkpoint,
    taken_action_logprobs,
)
from .tasks import Task

if TYPE_CHECKING:
    from ..fusion.engine import AdaFuse

__all__ = ["imitate_threshold", "train_fusion_gate"]


def train_fusion_gate(fuser: "AdaFuse", gate: FusionGate, tasks: list[Task], *, steps: int = 40, prompts_per_step: int = 4,
                      samples_per_prompt: int = 4, forward_cost: float = 0.005, max_new_tokens: int = 32,
                      stop: tuple[str, ...] = ("\n",), learning_rate: float = 3e-3, warm_start_tau: float | None = 0.7,
                      batch_size: int | None = None, checkpoint: Path | None = None, seed: int = 0) -> list[dict[str, float]]:
    """REINFORCE on the fused decoder: reward = correct - forward_cost x forward passes the prompt took (all
    models). Per-prompt mean baseline; prompts whose samples all earn the same reward are skipped, and
    decisions where the model's top token has probability above 0.95 are masked. A checkpoint (gate, optimizer,
    step, history) is written every step and resumed from when present. `batch_size` caps the rollouts decoded
    together (see `AdaFuse.generate`).

    With `warm_start_tau`, the gate first imitates the τΔ rule (softly, so sampling still explores), so
    training starts from AdaFuse's own behaviour rather than from coin flips.
    """
    optimizer = torch.optim.Adam(gate.parameters(), lr=learning_rate)
    start, history = load_checkpoint(checkpoint, gate, optimizer)
    if not start and warm_start_tau is not None:
        imitate_threshold(fuser, gate, [t.prompt for t in tasks[: 2 * prompts_per_step]], warm_start_tau,
                          max_new_tokens=max_new_tokens, stop=stop, seed=seed, batch_size=batch_size)
    generator = torch.Generator().manual_seed(seed + start)
    rng = random.Random(seed)
    for _ in range(start):
        rng.sample(range(len(tasks)), min(prompts_per_step, len(tasks)))
    for step in tqdm(range(start, steps), desc="train fusion gate", initial=start, total=steps):
        chosen = [tasks[i] for i in rng.sample(range(len(tasks)), min(prompts_per_step, len(tasks)))]
        prompts = [task.prompt for task in chosen for _ in range(samples_per_prompt)]
        session = GateSession(gate.eval(), sample=True, generator=generator)
        results = fuser.generate(prompts, max_new_tokens=max_new_tokens, stop=list(stop), gate=session,
                                 max_batch_size=batch_size)
        correct = torch.tensor([float(task.check(r.text)) for task, r in zip(
            (t for t in chosen for _ in range(samples_per_prompt)), results)]).view(len(chosen), samples_per_prompt)
        passes = torch.tensor([float(sum(r.stats.row_forward_passes.values())) for r in results]).view_as(correct)
        rewards = correct - forward_cost * passes
        useful = informative_prompts(rewards)
        record = {"step": step + 1, "accuracy": float(correct.mean()), "forward_passes": float(passes.mean()),
                  "reward": float(rewards.mean()), "informative_prompts": int(useful.sum()), "loss": 0.0}
        losses = []
        gate.train()
        for p in useful.nonzero().flatten().tolist():
            for k in range(samples_per_prompt):
                decisions = session.decisions.get(p * samples_per_prompt + k, [])
                if decisions:
                    losses.append(_decision_loss(gate, decisions, rewards[p, k], rewards[p].mean()))
        record["loss"] = policy_step(optimizer, losses)
        gate.eval()
        history.append(record)
        save_checkpoint(checkpoint, gate, optimizer, step + 1, history)
    return history


def imitate_threshold(fuser: "AdaFuse", gate: FusionGate, prompts: list[str], tau: float, *, max_new_tokens: int = 32,
                      stop: tuple[str, ...] = ("\n",), confidence: float = 0.85, steps: int = 300, seed: int = 0,
                      batch_size: int | None = None) -> float:
    """Fit the gate to the rule margin >= tau on states met while decoding `prompts`, with soft targets
    (`confidence` for the rule's action) so that the policy still samples the other action sometimes.
    Returns the share of states on which the fitted gate's argmax agrees with the rule."""
    session = GateSession(gate.eval(), sample=True, generator=torch.Generator().manual_seed(seed))
    fuser.generate(prompts, max_new_tokens=max_new_tokens, stop=list(stop), gate=session, max_batch_size=batch_size)
    decisions = [d for row in session.decisions.values() for d in row]
    optimizer = torch.optim.Adam(gate.parameters(), lr=1e-2)
    by_model = {m: [d for d in decisions if d.model_index == m] for m in sorted({d.model_index for d in decisions})}
    inputs = {m: (torch.stack([d.hidden for d in mine]).clone(), torch.stack([d.features for d in mine]).clone())
              for m, mine in by_model.items()}
    gate.train()
    for _ in range(steps):
        loss = torch.zeros(())
        for m, (hidden, features) in inputs.items():
            rule = (features[:, 1] >= tau).long()
            target = torch.full((len(rule), 2), 1 - confidence)
            target[torch.arange(len(rule)), rule] = confidence
            loss = loss - (target * torch.log_softmax(gate(m, hidden, features), -1)).sum(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    gate.eval()
    with torch.no_grad():
        agree = [((gate(m, h, f).argmax(-1) == COMMIT) == (f[:, 1] >= tau)).float() for m, (h, f) in inputs.items()]
    return float(torch.cat(agree).mean())


def _decision_loss(gate: FusionGate, decisions: list[GateDecision], reward: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    logprobs, top1 = [], []
    for model_index in sorted({d.model_index for d in decisions}):
        mine = [d for d in decisions if d.model_index == model_index]
        # clone(): the states were recorded under inference_mode, whose tensors autograd cannot save
        hidden = torch.stack([d.hidden for d in mine]).clone()
        features = torch.stack([d.features for d in mine]).clone()
        logits = gate(model_index, hidden, features)
        logprobs.append(taken_action_logprobs(logits, [d.action for d in mine]))
        top1.append(features[:, 2])
    rewards = torch.full((len(decisions),), float(reward))
    return reinforce_loss(torch.cat(logprobs), rewards, confident_step_mask(torch.cat(top1)), baseline=baseline)
