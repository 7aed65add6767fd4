"""Learned decoding adapters: action-set selection, REINFORCE, masking and persistence."""
import pytest
import torch

from adafuse import SamplingFilter
from adafuse.sampling.policies import SequenceAdapter, TokenAdapter
from adafuse.training.reinforce import confident_step_mask, greedy_coverage, informative_prompts, reinforce_loss


def test_greedy_coverage_on_a_hand_made_reward_matrix():
    rewards = torch.tensor([  # rows: prompts, columns: configurations
        [1, 1, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],
        [0, 1, 0, 1],
        [0, 0, 0, 1],
    ])
    # column 1 solves 3 prompts; then column 2 and column 3 each add one (3 wins the tie on total reward)
    assert greedy_coverage(rewards, 3) == [1, 3, 2]
    assert greedy_coverage(rewards, 10) == [1, 3, 2, 0]


def test_reinforce_moves_probability_toward_the_rewarded_action():
    torch.manual_seed(0)
    logits = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([logits], lr=0.5)
    for _ in range(200):
        actions = torch.distributions.Categorical(logits=logits).sample((16,))
        rewards = (actions == 2).float()
        loss = reinforce_loss(torch.log_softmax(logits, -1)[actions], rewards)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.softmax(logits, -1)[2] > 0.9


def test_masked_steps_contribute_no_gradient():
    logprobs = torch.zeros(4, requires_grad=True)
    mask = confident_step_mask(torch.tensor([0.5, 0.99, 0.7, 0.96]))
    assert mask.tolist() == [True, False, True, False]
    reinforce_loss(logprobs, torch.tensor([1.0, 0.0, 0.0, 1.0]), mask).backward()
    assert logprobs.grad[1] == 0 and logprobs.grad[3] == 0 and logprobs.grad[0] != 0


def test_prompts_with_constant_rewards_are_filtered():
    rewards = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 0]])
    assert informative_prompts(rewards).tolist() == [False, False, True]


def test_save_load_round_trip(tmp_path):
    choices = [SamplingFilter(), SamplingFilter(temperature=0.7, top_p=0.9)]
    sequence = SequenceAdapter(8, choices, hidden=16, base_model="smollm2-135m")
    token = TokenAdapter(12, projection=4, hidden=8, base_model="smollm2-135m")
    embedding, budgets = torch.randn(2, 8), torch.tensor([1, 8])
    states, features = torch.randn(3, 12), torch.rand(3, 3)
    loaded_sequence = SequenceAdapter.load(sequence.save(tmp_path / "seq"))
    loaded_token = TokenAdapter.load(token.save(tmp_path / "tok"))
    assert loaded_sequence.choices == choices and loaded_sequence.base_model == "smollm2-135m"
    assert torch.equal(loaded_sequence(embedding, budgets), sequence(embedding, budgets))
    assert torch.equal(loaded_token(states, features), token(states, features))
    with pytest.raises(ValueError, match="does not hold a token adapter"):
        TokenAdapter.load(tmp_path / "seq")
    with pytest.raises(FileNotFoundError, match="no adapter"):
        TokenAdapter.load(tmp_path / "missing")


def test_token_step_features_are_bounded():
    logprobs = torch.log_softmax(torch.randn(5, 50), -1)
    features = TokenAdapter.step_features(logprobs, torch.linspace(0, 1, 5))
    assert features.shape == (5, 3)
    assert ((features >= 0) & (features <= 1)).all()


def test_token_adapter_runs_inside_generation(llama_backend):
    from adafuse.sampling.adaptive import AdaptiveSampler

    adapter = TokenAdapter(llama_backend.model.config.hidden_size, projection=8, hidden=16)
    prompts = ["Question: who wrote Hamlet?\nAnswer:", "The quick brown fox"]
    rollouts = AdaptiveSampler(llama_backend, adapter).sample(prompts, max_new_tokens=5, generator=torch.Generator().manual_seed(0), explore=True)
    assert len(rollouts) == 2
    for rollout in rollouts:
        assert 1 <= len(rollout.actions) <= 5 and all(0 <= a < 4 for a in rollout.actions)
        assert len(rollout.hidden) == len(rollout.features) == len(rollout.actions)


def test_greedy_sampler_matches_greedy_fusion_of_one_model(llama_backend):
    from adafuse import AdaFuse, FusionConfig
    from adafuse.sampling.adaptive import AdaptiveSampler

    prompt = "Question: who wrote Hamlet?\nAnswer:"
    sampled = AdaptiveSampler(llama_backend).sample([prompt], max_new_tokens=6)[0]
    fused = AdaFuse([llama_backend], FusionConfig(tau_delta=0.0, num_branches=1, max_new_tokens=6)).generate(prompt)
    assert sampled.text == fused.text


def test_training_a_few_steps_runs_and_resumes(llama_backend, tmp_path):
    from adafuse.training.adapters import train_token_adapter
    from adafuse.training.tasks import Task

    adapter = TokenAdapter(llama_backend.model.config.hidden_size, projection=8, hidden=16)
    tasks = [Task("Question: who wrote Hamlet?\nAnswer:", lambda text: len(text) % 2 == 0),
             Task("The quick brown fox", lambda text: len(text) % 2 == 0)]
    before = [p.detach().clone() for p in adapter.parameters()]
    checkpoint = tmp_path / "checkpoint.safetensors"
    history = train_token_adapter(llama_backend, adapter, tasks, steps=2, prompts_per_step=2, samples_per_prompt=3,
                                  max_new_tokens=4, checkpoint=checkpoint)
    assert [h["step"] for h in history] == [1, 2] and checkpoint.exists()
    assert any(h["informative_prompts"] > 0 and h["loss"] != 0 for h in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, adapter.parameters()))
    resumed = train_token_adapter(llama_backend, adapter, tasks, steps=3, prompts_per_step=2, samples_per_prompt=3,
                                  max_new_tokens=4, checkpoint=checkpoint)
    assert [h["step"] for h in resumed] == [1, 2, 3]


def test_sequence_adapter_learns_the_configuration_that_pays():
    from adafuse.training.adapters import train_sequence_adapter

    torch.manual_seed(0)
    embeddings = torch.randn(6, 8)
    table = torch.tensor([[0.0, 1.0, 0.0]] * 6)  # configuration 1 always wins
    table[0] = torch.tensor([1.0, 1.0, 1.0])  # a constant row, filtered out
    adapter = SequenceAdapter(8, [SamplingFilter(), SamplingFilter(0.7), SamplingFilter(1.0)], hidden=16)
    history = train_sequence_adapter(adapter, embeddings, {1: table, 4: table}, steps=60)
    assert history[-1]["reward"] >= history[0]["reward"]
    assert all(adapter.choose(e, 4) == SamplingFilter(0.7) for e in embeddings)


def test_majority_vote_and_prompt_embeddings(llama_backend):
    from adafuse.sampling.adaptive import majority_answer, prompt_embeddings

    assert majority_answer([" 7", " 8\nQuestion", " 8", " 7 "]) == "7"
    embeddings = prompt_embeddings(llama_backend, ["one prompt", "another, longer prompt"])
    assert embeddings.shape == (2, llama_backend.model.config.hidden_size)


def test_parallel_samples_share_the_prefill_and_match_repeated_prompts(llama_backend):
    from adafuse.sampling.adaptive import AdaptiveSampler

    prompts = ["Question: who wrote Hamlet?\nAnswer:", "The quick brown fox"]
    sampler, hot = AdaptiveSampler(llama_backend), SamplingFilter(temperature=1.0)
    llama_backend.reset_counters()
    shared = sampler.sample(prompts, choice=hot, max_new_tokens=6, generator=torch.Generator().manual_seed(3), samples_per_prompt=3)
    shared_tokens = llama_backend.reset_counters()["tokens"]
    repeated = sampler.sample([p for p in prompts for _ in range(3)], choice=hot, max_new_tokens=6,
                              generator=torch.Generator().manual_seed(3))
    repeated_tokens = llama_backend.reset_counters()["tokens"]
    assert [r.text for r in shared] == [r.text for r in repeated]
    assert len({r.text for r in shared}) > 2  # they are samples, not copies
    assert shared_tokens < repeated_tokens
    together = sampler.sample(prompts, max_new_tokens=6)
    one_by_one = sampler.sample(prompts, max_new_tokens=6, max_batch_rows=1)
    assert [r.text for r in together] == [r.text for r in one_by_one]


def _adapter_pair(pair, tmp_path, temperature_logits):
    """A token adapter for the pair's first model whose policy always picks the given temperature index."""
    backend = pair.backends[0]
    token = TokenAdapter(backend.model.config.hidden_size, projection=8, hidden=16, base_model=backend.name)
    with torch.no_grad():
        token.policy[-1].weight.zero_()
        token.policy[-1].bias.copy_(torch.tensor(temperature_logits))
    return str(token.save(tmp_path / "token"))


def test_adapters_are_decoding_options_of_the_engine(pair, tmp_path):
    from adafuse.sampling.adaptive import AdaptiveSampler

    prompt = "Question: who wrote Hamlet?\nAnswer:"
    greedy_token = _adapter_pair(pair, tmp_path, [10.0, -10.0, -10.0, -10.0])
    result = pair.generate(prompt, token_adapter=greedy_token, max_new_tokens=6)
    alone = AdaptiveSampler(pair.backends[0]).sample([prompt], max_new_tokens=6)[0]
    assert result.text == alone.text and result.stats.new_tokens == alone.new_tokens
    assert set(result.stats.forward_passes) == {pair.backends[0].name}

    hot = SamplingFilter(temperature=1.0)
    sequence = SequenceAdapter(pair.backends[0].model.config.hidden_size, [hot], hidden=8, base_model=pair.backends[0].name)
    folder = str(sequence.save(tmp_path / "sequence"))
    voted = pair.generate([prompt, "The quick brown fox"], sequence_adapter=folder, num_samples=5, max_new_tokens=4, seed=1)
    samples = AdaptiveSampler(pair.backends[0]).sample([prompt, "The quick brown fox"], choice=hot, max_new_tokens=4,
                                                       samples_per_prompt=5, generator=torch.Generator().manual_seed(1))
    answers = [s.text.strip().split("\n")[0].strip() for s in samples[:5]]
    assert voted[0].text.strip().split("\n")[0].strip() == max(answers, key=answers.count)


def test_bad_adapter_options_name_the_problem(pair, tmp_path):
    with pytest.raises(ValueError, match="num_samples"):
        pair.generate("a prompt", num_samples=4)
    folder = _adapter_pair(pair, tmp_path, [10.0, -10.0, -10.0, -10.0])
    with pytest.raises(ValueError, match="fusion_gate"):
        pair.generate("a prompt", token_adapter=folder, fusion_gate="adafuse-default-gate-arithmetic")
    with pytest.raises(FileNotFoundError, match="no token adapter"):
        pair.generate("a prompt", token_adapter=str(tmp_path / "missing"))
    stranger = TokenAdapter(pair.backends[0].model.config.hidden_size, base_model="some-other-model")
    with pytest.raises(ValueError, match="some-other-model"):
        pair.generate("a prompt", token_adapter=str(stranger.save(tmp_path / "stranger")))
