"""Single-model sampling whose temperature is chosen per step by a TokenAdapter, and its REINFORCE training.

The sampler runs on the same KV-tree core as AdaFuse (batched rows, prompt-prefix reuse, exact masks).
"""
from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from .adapters import (
    SamplingChoice, SequenceAdapter, TokenAdapter, confident_step_mask, informative_prompts, load_checkpoint, policy_step,
    reinforce_loss, save_checkpoint,
)
from .backend import ModelBackend
from .sampling import filtered_probs

logger = logging.getLogger(__name__)

__all__ = [
    "AdaptiveSampler", "CANDIDATE_CHOICES", "Rollout", "Task", "arithmetic_tasks", "benchmark_tasks", "best_of", "majority_answer", "majority_index",
    "prompt_embeddings", "reward_table", "task_stop", "train_sequence_adapter", "train_token_adapter",
]

GREEDY = SamplingChoice()
# Rows decoded together when filling reward tables: bounds the KV cache of long benchmark prompts.
_REWARD_BATCH_ROWS = 64


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


@dataclass(frozen=True)
class Task:
    """A prompt with a checkable answer: `check(completion)` is the verifiable reward."""

    prompt: str
    check: Callable[[str], bool]
    stop: tuple[str, ...] = ("\n",)


def task_stop(tasks: list[Task]) -> tuple[str, ...]:
    """The stop sequences of tasks decoded together (they must agree)."""
    stops = {task.stop for task in tasks}
    if len(stops) > 1:
        raise ValueError(f"tasks decoded together need the same stop sequences, got {sorted(stops)}")
    return stops.pop() if stops else ("\n",)


class AdaptiveSampler:
    """Decode a batch of prompts with one model, sampling each step at a fixed or adapter-chosen temperature."""

    def __init__(self, backend: ModelBackend, adapter: TokenAdapter | None = None):
        self.backend, self.adapter = backend, adapter

    def sample(self, prompts: list[str], *, choice: SamplingChoice | list[SamplingChoice] = GREEDY, max_new_tokens: int = 64,
               stop: tuple[str, ...] = (), generator: torch.Generator | None = None, explore: bool = False,
               samples_per_prompt: int = 1, max_batch_rows: int | None = None) -> list[Rollout]:
        """`samples_per_prompt` rollouts of each prompt (prompt-major), sharing its prefill. `choice` is one
        configuration or one per prompt. With an adapter, its policy picks each step's temperature (sampled
        when `explore`, else argmax). At most `max_batch_rows` rows decode together (default: all)."""
        choices = list(choice) if isinstance(choice, list) else [choice] * len(prompts)
        per_batch = max(1, (max_batch_rows or len(prompts) * samples_per_prompt) // samples_per_prompt)
        return [
            rollout
            for start in range(0, len(prompts), per_batch)
            for rollout in self._sample_batch(prompts[start:start + per_batch], choices[start:start + per_batch],
                                              max_new_tokens, stop, generator, explore, samples_per_prompt)
        ]

    @torch.inference_mode()
    def _sample_batch(self, prompts: list[str], choices: list[SamplingChoice], max_new_tokens: int, stop: tuple[str, ...],
                      generator: torch.Generator | None, explore: bool, samples_per_prompt: int) -> list[Rollout]:
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
                spans.append(None if done else [token])
            batch.commit(spans)
            active = [r for r, span in zip(active, spans) if span is not None]
            if not active:
                break
        return rollouts

    def _temperatures(self, batch, logprobs, remaining: float, rollouts: list[Rollout], explore: bool,
                      generator: torch.Generator | None, choices: list[SamplingChoice]) -> list[float]:
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
    def _pick(logprobs: torch.Tensor, temperature: float, choice: SamplingChoice, generator: torch.Generator | None) -> int:
        if temperature <= 0:
            return int(logprobs.argmax())
        settings = SamplingChoice(temperature, choice.top_k, choice.top_p, choice.min_p)
        return int(torch.multinomial(filtered_probs(logprobs, settings), 1, generator=generator))


def arithmetic_tasks(count: int, seed: int = 0) -> list[Task]:
    """Generated one-step sums and differences with known answers: a reward the tiny default models can earn."""
    rng = random.Random(seed)
    shots = "Question: What is 3 + 4?\nAnswer: 7\n\nQuestion: What is 9 - 5?\nAnswer: 4\n\n" \
            "Question: What is 6 + 2?\nAnswer: 8\n\nQuestion: What is 8 - 6?\nAnswer: 2\n\n"
    tasks = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {a + b} - {b}?", a
        tasks.append(Task(f"{shots}Question: {question}\nAnswer:", _number_check(answer)))
    return tasks


def benchmark_tasks(name: str, rows: range, data_root: Path | None = None) -> list[Task]:
    """Rows of one QA or math benchmark as tasks; the reward is the benchmark's own accuracy (lenient match or
    final number) of the extracted answer."""
    from .benchmarks import BENCHMARKS, benchmark_root

    bench = BENCHMARKS.get(name)
    if bench is None or bench.kind == "translation":
        raise ValueError(f"unknown task {name!r}: use arithmetic or a QA/math benchmark ({', '.join(b for b, v in BENCHMARKS.items() if v.kind != 'translation')})")
    few_shot, table = bench.load(Path(data_root) if data_root else benchmark_root(), len(rows), rows.start)
    return [
        Task(bench.prompt(few_shot, row["question"]),
             lambda completion, answer=row["answer"]: bench.score_row(bench.extract(completion), answer)["accuracy"] > 0,
             tuple(bench.stop))
        for row in table.values()
    ]


def _number_check(answer: float) -> Callable[[str], bool]:
    from .benchmarks import final_number

    def check(completion: str) -> bool:
        found = final_number(completion.split("\n")[0] if completion.strip() else completion)
        return found is not None and abs(found - answer) < 1e-6

    return check


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
            losses = []
            for p in useful.nonzero().flatten().tolist():
                for k in range(samples_per_prompt):
                    rollout = rollouts[p * samples_per_prompt + k]
                    if not rollout.actions:
                        continue
                    # clone(): sampling ran under inference_mode, whose tensors autograd cannot save
                    logits = adapter(torch.stack(rollout.hidden).clone(), torch.stack(rollout.features).clone())
                    action_logprobs = torch.log_softmax(logits, -1)[torch.arange(len(rollout.actions)), torch.tensor(rollout.actions)]
                    mask = confident_step_mask(torch.tensor(rollout.max_probs[: len(rollout.actions)]))
                    reward = torch.full((len(rollout.actions),), float(rewards[p, k]))
                    losses.append(reinforce_loss(action_logprobs, reward, mask, baseline=rewards[p].mean()))
            record["loss"] = policy_step(optimizer, losses)
        history.append(record)
        save_checkpoint(checkpoint, adapter, optimizer, step + 1, history)
    adapter.eval()
    return history


CANDIDATE_CHOICES = (
    SamplingChoice(),
    SamplingChoice(temperature=0.3),
    SamplingChoice(temperature=0.7),
    SamplingChoice(temperature=1.0),
    SamplingChoice(temperature=0.7, top_k=20),
    SamplingChoice(temperature=1.0, top_p=0.9),
    SamplingChoice(temperature=1.0, min_p=0.1),
    SamplingChoice(temperature=1.3, top_k=40),
)


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
    """Index of the earliest sample whose first-line answer is the most frequent among parallel samples."""
    answers = [_answer_line(c) for c in completions]
    return max(range(len(answers)), key=lambda i: (answers.count(answers[i]), -i))


def majority_answer(completions: list[str]) -> str:
    """The most frequent first-line answer among parallel samples (earliest wins ties)."""
    return _answer_line(completions[majority_index(completions)]) if completions else ""


def _answer_line(completion: str) -> str:
    return completion.strip().split("\n")[0].strip()


def best_of(sampler: AdaptiveSampler, tasks: list[Task], choice: SamplingChoice, budget: int, max_new_tokens: int,
            generator: torch.Generator) -> list[bool]:
    """Draw `budget` samples per task with one configuration, majority-vote, and check each voted answer."""
    rollouts = sampler.sample([task.prompt for task in tasks], choice=choice, max_new_tokens=max_new_tokens, stop=task_stop(tasks),
                              generator=generator, samples_per_prompt=budget, max_batch_rows=_REWARD_BATCH_ROWS)
    return [task.check(majority_answer([r.text for r in rollouts[i * budget:(i + 1) * budget]])) for i, task in enumerate(tasks)]


def reward_table(backend: ModelBackend, tasks: list[Task], choices: list[SamplingChoice], budget: int,
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
        loss = torch.stack(losses).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({"step": step + 1, "loss": float(loss.detach()), "reward": sum(earned) / len(earned)})
    adapter.eval()
    return history
