"""REINFORCE training of the decoding adapters (arXiv 2603.09065) on verifiable rewards.

The token adapter learns from its own sampled rollouts; the sequence adapter is a contextual bandit trained on a
table of rewards that each candidate configuration earns at best-of-B majority voting.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm import tqdm

from ..backend import ModelBackend
from ..config import SamplingFilter
from ..sampling.adaptive import AdaptiveSampler, Rollout, majority_answer
from ..sampling.policies import SequenceAdapter, TokenAdapter
from .reinforce import (
    confident_step_mask, informative_prompts, load_checkpoint, policy_step, reinforce_loss, save_checkpoint,
    taken_action_logprobs,
)
from .tasks import Task, task_stop

__all__ = ["CANDIDATE_CHOICES", "best_of", "reward_table", "train_sequence_adapter", "train_token_adapter"]

# Rows decoded together when filling reward tables: bounds the KV cache of long benchmark prompts.
_REWARD_BATCH_ROWS = 64


def train_token_adapter(
    backend: ModelBackend,
    adapter: TokenAdapter,
    tasks: list[Task],
    *,
    steps: int = 50,
    prompts_per_step: int = 4,
    samples_per_prompt: int = 4,
    max_new_tokens: int = 8,
    learning_rate: float = 3e-3,
    checkpoint: Path | None = None,
    seed: int = 0,
) -> list[dict[str, float]]:
    """REINFORCE on the terminal reward, with a per-prompt mean baseline; prompts whose rewards are all equal
    are skipped, and steps where the model's top token has probability above 0.95 are masked out.
    A checkpoint (adapter + optimizer + step) is written every step and resumed from when present.
    """
    optimizer = torch.optim.Adam(adapter.parameters(), lr=learning_rate)
    start, history = load_checkpoint(checkpoint, adapter, optimizer)
    sampler = AdaptiveSampler(backend, adapter)
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for step in tqdm(range(start, steps), desc="train token adapter", initial=start, total=steps):
        chosen = [tasks[rng.randrange(len(tasks))] for _ in range(prompts_per_step)]
        adapter.eval()
        rollouts = sampler.sample([task.prompt for task in chosen], max_new_tokens=max_new_tokens, stop=task_stop(chosen),
                                  generator=generator, explore=True, samples_per_prompt=samples_per_prompt)
        rewards = torch.tensor([float(task.check(r.text)) for task, r in zip(
            (t for t in chosen for _ in range(samples_per_prompt)), rollouts)]).view(prompts_per_step, samples_per_prompt)
        useful = informative_prompts(rewards)
        record = {"step": step + 1, "reward": float(rewards.mean()), "informative_prompts": int(useful.sum()), "loss": 0.0}
        if useful.any():
            adapter.train()
            record["loss"] = policy_step(optimizer, _rollout_losses(adapter, rollouts, rewards, useful))
        history.append(record)
        save_checkpoint(checkpoint, adapter, optimizer, step + 1, history)
    adapter.eval()
    return history


def _rollout_losses(adapter: TokenAdapter, rollouts: list[Rollout], rewards: torch.Tensor, useful: torch.Tensor) -> list[torch.Tensor]:
    """The REINFORCE loss of every rollout of the informative prompts (rewards: prompts x samples)."""
    samples_per_prompt = rewards.shape[1]
    losses = []
    for p in useful.nonzero().flatten().tolist():
        for k in range(samples_per_prompt):
            rollout = rollouts[p * samples_per_prompt + k]
            if not rollout.actions:
                continue
            # clone(): sampling ran under inference_mode, whose tensors autograd cannot save
            logits = adapter(torch.stack(rollout.hidden).clone(), torch.stack(rollout.features).clone())
            mask = confident_step_mask(torch.tensor(rollout.max_probs[: len(rollout.actions)]))
            reward = torch.full((len(rollout.actions),), float(rewards[p, k]))
            losses.append(reinforce_loss(taken_action_logprobs(logits, rollout.actions), reward, mask,
                                         baseline=rewards[p].mean()))
    return losses


CANDIDATE_CHOICES = (
    SamplingFilter(),
    SamplingFilter(temperature=0.3),
    SamplingFilter(temperature=0.7),
    SamplingFilter(temperature=1.0),
    SamplingFilter(temperature=0.7, top_k=20),
    SamplingFilter(temperature=1.0, top_p=0.9),
    SamplingFilter(temperature=1.0, min_p=0.1),
    SamplingFilter(temperature=1.3, top_k=40),
)


def best_of(sampler: AdaptiveSampler, tasks: list[Task], choice: SamplingFilter, budget: int, max_new_tokens: int,
            generator: torch.Generator) -> list[bool]:
    """Draw `budget` samples per task with one configuration, majority-vote, and check each voted answer."""
    rollouts = sampler.sample([task.prompt for task in tasks], choice=choice, max_new_tokens=max_new_tokens, stop=task_stop(tasks),
                              generator=generator, samples_per_prompt=budget, max_batch_rows=_REWARD_BATCH_ROWS)
    return [task.check(majority_answer([r.text for r in rollouts[i * budget:(i + 1) * budget]])) for i, task in enumerate(tasks)]


def reward_table(backend: ModelBackend, tasks: list[Task], choices: list[SamplingFilter], budget: int,
                 max_new_tokens: int, seed: int = 0) -> torch.Tensor:
    """[tasks, choices] 0/1 rewards of best-of-`budget` majority voting with each configuration."""
    sampler, generator = AdaptiveSampler(backend), torch.Generator().manual_seed(seed)
    columns = [best_of(sampler, tasks, c, budget, max_new_tokens, generator) for c in tqdm(choices, desc=f"rewards B={budget}")]
    return torch.tensor(columns, dtype=torch.float).T


def train_sequence_adapter(adapter: SequenceAdapter, embeddings: torch.Tensor, rewards: dict[int, torch.Tensor], *,
                           steps: int = 300, learning_rate: float = 3e-3, samples: int = 8, seed: int = 0) -> list[dict[str, float]]:
    """REINFORCE for the contextual bandit: sample configurations for each (prompt, budget), reward from the
    table, per-prompt mean baseline; prompts whose rewards are equal for every configuration are skipped."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(adapter.parameters(), lr=learning_rate)
    history = []
    adapter.train()
    for step in range(steps):
        losses, earned = [], []
        for budget, table in rewards.items():
            useful = informative_prompts(table)
            if not useful.any():
                continue
            logits = adapter(embeddings[useful], torch.full((int(useful.sum()),), budget))
            actions = torch.multinomial(torch.softmax(logits.detach(), -1), samples, replacement=True, generator=generator)
            chosen = table[useful].gather(1, actions)
            logprobs = torch.log_softmax(logits, -1).gather(1, actions)
            losses.append(reinforce_loss(logprobs, chosen, baseline=chosen.mean(1, keepdim=True)))
            earned.append(float(chosen.mean()))
        if not losses:
            break
        loss = policy_step(optimizer, losses)
        history.append({"step": step + 1, "loss": loss, "reward": sum(earned) / len(earned)})
    adapter.eval()
    return history
